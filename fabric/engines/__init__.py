"""kvfabric as the external KV store of engines that run outside it.

- ``sglang``: an SGLang HiCache storage backend (``--hicache-storage-backend
  dynamic``), used inside SGLang's scheduler process;
- ``vllm``: a secondary tier of vLLM's offloading connector;
- ``vllm_connector``: a vLLM engine as a full client of a running fabric (a
  KV connector: ``vllm_scheduler`` in its engine core, ``vllm_worker`` in each
  worker, ``vllm_pages`` what they share, ``fabric_link`` its calls to the
  coordinator);
- ``hf``: Hugging Face ``generate()`` continuing from KV the store holds;
- ``store``: where their pages go — straight to a kvfabric L3 directory, or
  through a running fabric's storage actor over Ray — with every check L3 makes
  (key binding, checksum, provenance);
- ``keys``: how each engine's own page names map to kvfabric L3 keys.

``store`` and ``keys`` import neither torch nor the engines; each adapter
imports its engine (and torch) at module import, as it runs inside that engine.
"""

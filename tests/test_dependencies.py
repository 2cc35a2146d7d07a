"""Every third-party module the package imports is a declared dependency, so a
fresh virtualenv that installs the project as the README says can import it."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fabric", "actors", "policies")
# Extras a user installs on purpose; the code imports them lazily and says how.
OPTIONAL_EXTRAS = ("redis", "auth", "model", "plot", "sglang", "vllm")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in OPTIONAL_EXTRAS:
        reqs += project.get("optional-dependencies", {}).get(extra, [])
    return {_norm(re.split(r"[\s\[<>=!~;@]", r, maxsplit=1)[0]) for r in reqs}


def _imports() -> dict[str, str]:
    found: dict[str, str] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    found.setdefault(name.split(".")[0], str(path.relative_to(ROOT)))
    return found


def test_every_third_party_import_is_declared():
    declared, providers = _declared(), packages_distributions()
    local = set(PACKAGES) | {"__future__"}
    missing = []
    for module, where in sorted(_imports().items()):
        if module in sys.stdlib_module_names or module in local:
            continue
        # An engine not installed here (fabric.engines runs inside it) is declared
        # under its own name.
        dists = {_norm(d) for d in providers.get(module, [])} or {_norm(module)}
        if not dists & declared:
            missing.append(f"{module} (imported in {where}; provided by {sorted(dists)})")
    assert not missing, f"undeclared imports: {missing}"

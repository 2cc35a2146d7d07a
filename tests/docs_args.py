"""Run each documented ``python`` command up to its argument parsing, in this one
process (``tests/test_docs.py`` starts it once for them all): reads a JSON list
of argv lists on stdin, prints one JSON object mapping each (joined) to ``"ok"``
or what refused it. A script's ``parse_args`` parses as it would, then stops
the script; nothing past it runs."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class Parsed(Exception):
    pass


def takes(argv: list[str]) -> str:
    real = argparse.ArgumentParser.parse_args

    def parsed(self, args=None, namespace=None):
        real(self, args, namespace)
        raise Parsed

    argparse.ArgumentParser.parse_args = parsed
    saved, err = sys.argv, io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(argv)
                runpy.run_path(str(ROOT / argv[0]), run_name="__main__")
    except Parsed:
        return "ok"
    except SystemExit as exc:
        return f"exit {exc.code}: {err.getvalue().strip()[-400:]}"
    except BaseException as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        argparse.ArgumentParser.parse_args = real
        sys.argv = saved
    return "it never parsed its arguments"


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    print(json.dumps({" ".join(a): takes(a) for a in json.load(sys.stdin)}))

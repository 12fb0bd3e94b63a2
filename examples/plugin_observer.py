"""Writing a third-party plugin: an observer that logs prefix hits, loaded through its entry point.

Needs: the `transformers` extra (`make demo` installs it).

The plugin lives in ``examples/prefix_logger_plugin`` (a module with one ``@hookimpl`` and a pyproject that declares
the ``pagedcore`` entry point). Install it once, then any pagedcore application loads it:

    pip install examples/prefix_logger_plugin
    python examples/plugin_observer.py

Without the install, this script registers the module by hand so that it still runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
from pathlib import Path

from pagedcore import default_plugin_manager
from pagedcore.adapters.transformers import Engine, SamplingParams
from pagedcore.adapters.transformers.builtin import builtin_model, builtin_tokenizer

PLUGIN_DIR = Path(__file__).resolve().parent / "prefix_logger_plugin"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="2 new tokens per question")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_new_tokens = 2
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    pm = default_plugin_manager()
    loaded = {info.name: info for info in pm.plugins()}
    if "prefix-logger" in loaded:
        print(f"prefix-logger plugin loaded from its {loaded['prefix-logger'].source}")
        import pagedcore_prefix_logger as plugin

        run(args.max_new_tokens)
    else:
        print("prefix-logger is not installed (pip install examples/prefix_logger_plugin); registering it by hand")
        spec = importlib.util.spec_from_file_location("prefix_logger_demo", PLUGIN_DIR / "pagedcore_prefix_logger.py")
        assert spec is not None and spec.loader is not None
        plugin = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(plugin)
        with pm.plugin(plugin, name="prefix-logger"):  # registered for this block only
            run(args.max_new_tokens)
    print(f"tally kept by the plugin: {plugin.TALLY}")
    return 0


def run(max_new_tokens: int) -> None:
    """Three questions with a common system prompt, one at a time: later ones hit the cached prompt."""
    system = "You are the help desk of a railway station. Answer briefly.\n"
    questions = ["When is the next train to the airport?", "Is there a lift to platform 3?", "Can I bring a bike?"]
    with Engine(builtin_model(), builtin_tokenizer(), num_blocks=256) as engine:
        for question in questions:
            engine.generate([system + question], SamplingParams(max_new_tokens=max_new_tokens), use_tqdm=False)


if __name__ == "__main__":
    raise SystemExit(main())

"""Started by torchrun from tests/test_tensor_parallel.py: every process runs ``sparsekv generate`` once per case,
with its own value of the options the case changes, and writes each run's exit status and output to
``FOLDER/r{rank}.json``. Arguments: a model folder whose heads divide by 2, one whose KV heads do not, FOLDER."""

import contextlib
import io
import json
import os
import sys

from sparsekv import cli, parallel

PROMPT = "The pass key is 4312. " * 3


def cases(model: str, bad_heads: str, folder: str) -> dict[str, dict[str, tuple]]:
    """Case name -> {option: (process 0's value, process 1's value)}; "" is a flag given, None one left out."""
    return {
        "same": {},
        "method": {"--method": ("quest:dense_layers=0", "h2o")},
        "spec": {"--method": ("quest:dense_layers=0", "quest:dense_layers=1")},
        "budget": {"--budget": ("16", "32")},
        "opt": {"--opt": ("page_size=16", "page_size=8")},
        "prompt": {"--prompt": (PROMPT, PROMPT.replace("4312", "4313"))},
        "prompt-file": {"--prompt-file": (f"{folder}/p0.txt", f"{folder}/p1.txt")},
        "prompt-file-same": {"--prompt-file": (f"{folder}/same.txt", f"{folder}/same.txt")},
        "max-new-tokens": {"--max-new-tokens": ("4", "5")},
        "seed": {"--sample": ("", ""), "--seed": ("0", "1")},
        "temperature": {"--sample": ("", ""), "--temperature": ("1.0", "0.5")},
        "sample": {"--sample": ("", None)},
        "chat": {"--chat": (None, "")},
        "dtype": {"--dtype": ("float32", "bfloat16")},
        "model": {"--model": (model, bad_heads)},
        "heads": {"--model": (bad_heads, bad_heads)},
    }


def main() -> None:
    rank = int(os.environ["RANK"])
    model, bad_heads, folder = sys.argv[1:4]
    with open(f"{folder}/p{rank}.txt", "w") as f:
        f.write(PROMPT * (10 + rank))  # long enough to be compared by digest
    with open(f"{folder}/same.txt", "w") as f:
        f.write(PROMPT)
    base = {"--model": model, "--prompt": PROMPT, "--method": "quest:dense_layers=0", "--budget": "16",
            "--max-new-tokens": "4"}
    # One process group for all cases but the last (a process cannot reliably start a second one): the last case
    # closes it as a real run does.
    parallel.start()
    close = parallel.finish
    parallel.finish = lambda wait=True: None
    results = {}
    all_cases = cases(model, bad_heads, folder)
    for i, (name, change) in enumerate(all_cases.items()):
        if i == len(all_cases) - 1:
            parallel.finish = close
        args = dict(base)
        for option, values in change.items():
            if option == "--prompt-file":
                args.pop("--prompt")
            args[option] = values[rank]
        argv = ["generate", "--no-progress"] + [x for k, v in args.items() if v is not None
                                                for x in ((k,) if v == "" else (k, v))]
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(argv)
        results[name] = {"code": code, "out": out.getvalue(), "err": err.getvalue()}
    with open(f"{folder}/r{rank}.json", "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()

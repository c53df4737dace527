"""What log-probabilities cost the serving runner's captured decode step (``serve.runner.Runner``), Llama-3-8B shape
(random weights, bf16, vocabulary 128256): ROWS rows of 512-token prompts decoded by METHOD at budget 2048, the step
timed (CUDA events, median of 30 steps, the host's read of the step's tokens included) with no row asking for
log-probabilities and with every row asking for the top 5, alternately, twice each; and ``engine.token_logprobs``
alone over ROWS rows of logits (a CUDA graph, median of 100 replays).

    PYTHONPATH=$PWD python benchmarks/results/serve/logprobs_step.py METHOD ROWS OUT.json
"""
import json
import sys

import torch

from sparsekv.bench.common import Timer, fill_rows, shape_model
from sparsekv.engine import token_logprobs
from sparsekv.eval.runner import method_runs
from sparsekv.serve.runner import TOP_LOGPROBS, Runner

method, rows, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dev = torch.device("cuda")
prompt_len, max_context = 512, 4096
model = shape_model("llama3-8b", dev, torch.bfloat16, max_context)
config = method_runs([method], [2048])[0].config
runner = Runner(model, config, max_batch=rows, max_context=max_context, prefill_chunk=4096, cuda_graph=None,
                compile=False)
fill_rows(runner, rows, prompt_len, 1024)
timer = Timer(dev, reps=30, warmup=3)  # the warm-up runs each variant eagerly, then captures it
res = {"method": method, "rows": rows, "device": torch.cuda.get_device_name(dev), "steps_ms": []}
for scored in (False, True, False, True):
    runner.logprobs = [5 if scored else None] * rows
    ms = timer.eager(runner.decode)
    res["steps_ms"].append({"logprobs": scored, "ms": ms})
    print(f"{method} rows {rows} logprobs {scored}: step {ms:.3f} ms", flush=True)
logits = torch.randn(rows, model.config.vocab_size, device=dev, dtype=torch.bfloat16)
token = logits.argmax(-1)
res["token_logprobs_ms"] = Timer(dev, reps=100).graph(lambda: token_logprobs(logits, token, TOP_LOGPROBS))
print(f"token_logprobs over {rows} rows: {res['token_logprobs_ms'] * 1e3:.1f} us", flush=True)
json.dump(res, open(out, "w"), indent=1)

"""torchrun worker for test_rollout: for each layout in turn, parallelize the model, load Hugging Face weights into
the shards, generate greedily and sampled (RNG of (step 5, this data-parallel rank)), take the sampled tokens'
log-probs again through the sharded training forward, and write them to OUT/<layout>.<rank>.json; a layout the
native rollout refuses writes its error instead.

`python -m torch.distributed.run --nproc-per-node=2 tests/distributed/rollout_worker.py FOLDER LAYOUTS_JSON OUT`"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from nightloom.hf.config import shape_from_hf_config
from nightloom.hf.load import load_hf_weights
from nightloom.parallel import ParallelPlan
from nightloom.train.parallelize import build_parts
from nightloom.train.rollout.generate import generate, left_padded
from nightloom.train.rollout.logps import completion_logps, rollout_batch
from nightloom.train.rollout.sampling import SamplingParams, rollout_generator

PROMPTS = [[5, 17, 33, 2, 9, 61, 40], [8, 71], [12, 13, 14, 15]]


def main(folder: str, layouts_json: str, out: str) -> int:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    for name, plan in json.loads(layouts_json).items():
        rank = dist.get_rank()
        try:
            record = run_layout(folder, ParallelPlan(**plan))
        except NotImplementedError as e:
            record = {"error": str(e)}
        (Path(out) / f"{name}.{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()
    return 0


def run_layout(folder: str, plan: ParallelPlan) -> dict:
    dims = plan.dims()
    mesh = dims.build_mesh("cpu")
    shape = shape_from_hf_config(folder)
    if plan.tp > 1 and shape.vocab % plan.tp:
        shape = shape.padded_for_tp(plan.tp)
    model = build_parts(shape, plan, dims, mesh, 64, 99, torch.device("cpu"), None).parts[0]
    load_hf_weights([model], folder, shape)
    model.eval()
    greedy = generate(model, PROMPTS, SamplingParams(max_new_tokens=12, temperature=0), eos_ids=[], pad_id=0)
    dp_rank = dims.dp_rank(dist.get_rank())
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=50)
    sampled = generate(model, PROMPTS, params, eos_ids=[], pad_id=0, generator=rollout_generator(0, 5, dp_rank))
    ids, pad = left_padded(PROMPTS, None, 0)
    with torch.no_grad():
        again = completion_logps(model, rollout_batch(ids, pad, sampled))
    return {
        "dp_rank": dp_rank,
        "greedy": greedy.tokens.tolist(),
        "sampled": sampled.tokens.tolist(),
        "logprobs": sampled.logprobs.tolist(),
        "forward_logprobs": again.tolist(),
    }


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

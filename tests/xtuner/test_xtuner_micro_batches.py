"""Gradient accumulation by micro-batches (nightloom_micro.MicroBatchDDP), in the XTuner env on CPU: a rank's
batch cut into chunks is what the wider layout's ranks collated, and one rank accumulating two micro-batches
continues a 2-rank run's checkpoint with the 2-rank run's losses and weights (what recovery on fewer nodes
relies on)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from nightloom.finetune.launcher import WRAPPER
from nightloom.finetune.logs import launch_dirs, parse_launch
from nightloom.finetune.run import run_xtuner
from nightloom.metrics import read_metrics
from tests.support.xtuner_data import alpaca_rows, make_spec, run_in_env, write_shards

EXT = WRAPPER.parent / "xtuner_ext"


def QUIET(s):
    return None


def test_split_rows_equals_collating_each_ranks_rows(xtuner_env):
    """Chunk a of a collated batch == xtuner's collate of rows a::k alone (same values, same width), for an
    even split, an uneven one and an epoch's short last batch."""
    out = run_in_env(
        xtuner_env,
        f"""
import json, sys, torch
sys.path.insert(0, {str(EXT)!r})
from nightloom_micro import split_rows
from xtuner.dataset.collate_fns import default_collate_fn
g = torch.Generator().manual_seed(0)
def rows(n):
    out = []
    for _ in range(n):
        length = int(torch.randint(3, 17, (1,), generator=g))
        ids = torch.randint(5, 100, (length,), generator=g).tolist()
        out.append({{"input_ids": ids, "labels": [-100] * 2 + ids[2:]}})
    return out
checked = []
for n, k in [(4, 2), (6, 3), (7, 3), (1, 2)]:
    inst = rows(n)
    chunks = split_rows(default_collate_fn(inst), k)
    assert len(chunks) == min(n, k), (n, k, len(chunks))
    for a, chunk in enumerate(chunks):
        want = default_collate_fn(inst[a::k])["data"]
        got = chunk["data"]
        assert sorted(got) == sorted(want), (sorted(got), sorted(want))
        for name in want:
            assert got[name].shape == want[name].shape and torch.equal(got[name], want[name]), (n, k, a, name)
            assert got[name].is_contiguous()
    checked.append([n, k])
print(json.dumps(checked))
""",
    )
    assert json.loads(out.strip().splitlines()[-1]) == [[4, 2], [6, 3], [7, 3], [1, 2]]


def test_chunks_hold_the_wider_layouts_rows_at_every_step_of_an_epoch(xtuner_env):
    """For epochs of 1-39 samples, layouts W -> W' (k = W/W' chunks) and per-rank batches of 1-3: chunk a of
    narrow rank r' at step j holds exactly wide rank r' + W'a's batch at step j, last step of the epoch included,
    with MicroBatchSampler padding as for W ranks; mmengine's DefaultSampler alone (padding for W') does not."""
    out = run_in_env(
        xtuner_env,
        f"""
import json, sys
from unittest import mock
sys.path.insert(0, {str(EXT)!r})
import mmengine.dataset.sampler as ms
from nightloom_micro import MicroBatchSampler

class Data:
    def __init__(self, n): self.n = n
    def __len__(self): return self.n

def batches(n, world, b, pad_to):
    out = []
    for rank in range(world):
        with mock.patch.object(ms, "get_dist_info", return_value=(rank, world)):
            s = MicroBatchSampler(Data(n), shuffle=True, seed=7, pad_to=pad_to)
        s.set_epoch(0)
        idx = list(s)
        out.append([idx[i : i + b] for i in range(0, len(idx), b)])
    return out

def mismatches(pad_wide):
    bad = 0
    for n in range(1, 40):
        for wide_w, narrow_w in [(2, 1), (4, 2), (4, 1), (3, 1), (6, 2), (8, 2)]:
            k = wide_w // narrow_w
            for b in (1, 2, 3):
                wide = batches(n, wide_w, b, wide_w)
                narrow = batches(n, narrow_w, b * k, wide_w if pad_wide else 0)
                bad += len(wide[0]) != len(narrow[0])
                for j in range(min(len(wide[0]), len(narrow[0]))):
                    for r in range(narrow_w):
                        for a in range(k):
                            bad += wide[r + narrow_w * a][j] != narrow[r][j][a::k]
    return bad

print(json.dumps({{"padded_as_wide": mismatches(True), "default": mismatches(False)}}))
""",
    )
    d = json.loads(out.strip().splitlines()[-1])
    assert d["padded_as_wide"] == 0 and d["default"] > 0, d


@pytest.mark.parametrize("method", ["lora"])
def test_one_rank_accumulating_continues_a_two_rank_run(xtuner_env, base_model, tmp_path, method):
    """2 ranks x 1 sequence, 4 steps, a checkpoint every 2; then, from its step-2 checkpoint, 1 rank x 2
    micro-batches of 1 (torchrun, the re-rendered config recovery writes): steps 3-4 log the 2-rank run's
    losses (the mean over both sequences: the wrapper logs the whole step, so both layouts log the same thing)
    at the local resume test's tolerance, and the final weights agree."""
    shards = write_shards(tmp_path / "shards", alpaca_rows(48))
    two = make_spec(tmp_path, base_model, shards, method=method, ranks=2, global_batch=2, steps=4, checkpoint_every=2)
    r2 = run_xtuner(two, shards, tmp_path / "two", log=QUIET, env=xtuner_env, convert=False)
    dst = tmp_path / "one"
    shutil.copytree(tmp_path / "two", dst, ignore=shutil.ignore_patterns("result.json", "metrics.jsonl"))
    work = dst / "xtuner" / "work_dir"
    (work / "iter_4.pth").unlink()
    (work / "last_checkpoint").write_text(str(work / "iter_2.pth"))
    # 1 rank takes the global batch of 2 in micro-batches of 1, as recovery's replan keeps the first plan's
    one = make_spec(
        tmp_path, base_model, shards, method=method, ranks=1, global_batch=2, steps=4, checkpoint_every=2, micro_batch=1
    )
    # the copied config names the 2-rank run's folders: re-rendered for this folder by run_xtuner
    r1 = run_xtuner(one, shards, dst, log=QUIET, env=xtuner_env, convert=False)
    config = Path(r1.config_path).read_text()
    assert "batch_size = 2 " in config and "micro_batches = 2 " in config
    assert "--nproc-per-node=1" in (dst / "xtuner" / "logs" / "train.log").read_text()  # torchrun: DDP wraps
    newest = parse_launch(launch_dirs(work)[-1])
    assert [int(x["step"]) for x in newest] == [3, 4], "did not resume from iter_2"
    before = {m.step: m.loss for m in read_metrics(r2.metrics_path)}
    after = {int(x["step"]): float(x["loss"]) for x in newest}
    for step, loss in after.items():
        assert loss == pytest.approx(before[step], rel=1e-5, abs=1e-6), (step, before, after)
    out = run_in_env(
        xtuner_env,
        f"""
import json, torch
a = torch.load({str(tmp_path / "two" / "xtuner" / "work_dir" / "iter_4.pth")!r}, map_location="cpu",
               weights_only=False)["state_dict"]
b = torch.load({str(work / "iter_4.pth")!r}, map_location="cpu", weights_only=False)["state_dict"]
print(json.dumps({{"keys": sorted(a) == sorted(b), "n": len(a),
                   "diff": max((a[k].float() - b[k].float()).abs().max().item() for k in a),
                   "scale": max(a[k].float().abs().max().item() for k in a)}}))
""",
    )
    d = json.loads(out.strip().splitlines()[-1])
    assert d["keys"] and d["n"] > 0, d
    assert d["diff"] <= 1e-5 * max(d["scale"], 1.0), d

"""`nightloom eval RUN_DIR --data FILE.jsonl [--seq-len N] [--json]`: held-out loss of a run's latest checkpoint;
`nightloom eval RUN_DIR --tasks T1,T2 [--include-path DIR] [--base DIR] ...`: lm-evaluation-harness tasks on the
run's export (and a base beside it)."""

from __future__ import annotations

import json
from pathlib import Path

from flows.commands.common import UsageError, failed, require_dir, require_file, require_run_dir
from flows.commands.spec_flags import SpecFlag, add_spec_flags, layer
from nightloom.spec.benchmarks import BenchmarksSpec

#: lm-eval's settings, declared by the `validate.benchmarks` fields they set
_BENCH_FLAGS = (
    # the spec's words say "relative to the spec": here there is none, the path is the current folder's
    SpecFlag(
        "--include-path",
        "validate.benchmarks",
        "include_path",
        BenchmarksSpec,
        "a folder of your task YAMLs (lm-eval runs in it)",
    ),
    *(
        SpecFlag(f"--{name.replace('_', '-')}", "validate.benchmarks", name, BenchmarksSpec)
        for name in ("num_fewshot", "limit", "apply_chat_template", "fewshot_as_multiturn", "backend")
    ),
)


def register(sub) -> None:
    p = sub.add_parser(
        "eval",
        help="score a run's latest checkpoint on a JSONL file (mean NLL per token, ppl), or its export on "
        "lm-evaluation-harness tasks (--tasks)",
    )
    p.add_argument("run_dir", help="the run folder (holds job*.json and checkpoints/)")
    p.add_argument(
        "--data",
        help="JSONL file of documents ({'text': ...} per line); for a train.task sft run, chat records (messages, "
        "conversations or instruction/output), scored on their assistant tokens only; for a dpo run, preference "
        "pairs (prompt, chosen, rejected): the preference loss, reward accuracy and margin",
    )
    p.add_argument("--seq-len", type=int, default=None, help="tokens per document scored (default: the run's)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    b = p.add_argument_group("benchmarks (lm-evaluation-harness on RUN_DIR/export, offline)")
    b.add_argument("--tasks", help="comma-separated lm-eval task names")
    b.add_argument("--base", help="a Hugging Face folder scored beside the export (read with the export's tokenizer)")
    add_spec_flags(b, _BENCH_FLAGS)
    p.set_defaults(func=run)


def check_args(args) -> None:
    """The run folder, the data file or tasks, and --seq-len, checked before torch is imported (seconds)."""
    require_run_dir(args.run_dir)
    if (args.data is None) == (args.tasks is None):
        raise UsageError("give --data FILE (held-out loss) or --tasks T1,T2 (lm-eval benchmarks), one of them")
    if args.data is not None:
        require_file(args.data, "--data file")
    else:
        require_dir(Path(args.run_dir) / "export", "the run's export")
        for opt in ("include_path", "base"):
            if getattr(args, opt) is not None:
                require_dir(getattr(args, opt), f"--{opt.replace('_', '-')} folder")
    if args.seq_len is not None and args.seq_len < 2:
        raise UsageError("--seq-len must be >= 2")


def run(args) -> int:
    check_args(args)
    if args.tasks is not None:
        return run_tasks(args)
    from nightloom.tokenizer import TokenizerError
    from nightloom.train.evaluate import EvalError, evaluate_run, run_job

    if run_job(Path(args.run_dir)).train.task == "dpo":
        return run_pairs(args)
    try:
        r = evaluate_run(args.run_dir, args.data, args.seq_len)
    except (EvalError, TokenizerError, OSError) as e:
        return failed("eval", f"failed: {e}")
    if args.json:
        out = {"loss": r.loss, "tokens": r.tokens, "ppl": r.ppl, "documents": r.documents, "step": r.step}
        sft = {"task": r.task, "dropped": r.dropped} if r.task == "sft" else {}
        print(json.dumps(out | sft | {"checkpoint": r.checkpoint}, indent=2))
    else:
        what = "assistant tokens" if r.task == "sft" else "predicted tokens"
        print(
            f"{args.run_dir}: step {r.step}: loss {r.loss:.6f} ppl {r.ppl:.3f} over {r.tokens:,} {what} "
            f"in {r.documents} documents" + (f" ({r.dropped} too long, dropped)" if r.dropped else "")
        )
    return 0


def run_pairs(args) -> int:
    """A train.task dpo run on preference pairs: its preference loss, reward accuracy and margin against its
    reference, and TRL's other figures (nightloom/train/preference/evaluate.py)."""
    from nightloom.tokenizer import TokenizerError
    from nightloom.train.evaluate import EvalError
    from nightloom.train.preference.evaluate import evaluate_pairs

    try:
        r = evaluate_pairs(args.run_dir, args.data, args.seq_len)
    except (EvalError, TokenizerError, OSError) as e:
        return failed("eval", f"failed: {e}")
    f = r.figures
    if args.json:
        out = {"task": "dpo", "loss": f["loss"], "reward_accuracy": f["rewards/accuracies"]}
        out |= {"reward_margin": f["rewards/margins"], "pairs": r.pairs, "step": r.step}
        print(json.dumps(out | {k: v for k, v in f.items() if "/" in k} | {"checkpoint": r.checkpoint}, indent=2))
    else:
        print(
            f"{args.run_dir}: step {r.step}: preference loss {f['loss']:.6f} reward accuracy "
            f"{f['rewards/accuracies']:.3f} margin {f['rewards/margins']:.4f} over {r.pairs} pairs"
        )
    return 0


def run_tasks(args) -> int:
    """lm-eval on RUN_DIR/export (and --base): the base-vs-tuned table printed, lm-eval's raw result and log in
    RUN_DIR/eval/; unknown tasks and tasks needing the network are refused first (exit 1)."""
    from pydantic import ValidationError

    from nightloom.benchmarks.compare import rows, table_rows
    from nightloom.benchmarks.launch import BenchmarkError
    from nightloom.benchmarks.stage import score_run_folder

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    try:
        given = {"tasks": tasks, "base": args.base is not None, "completions": 0}
        settings = BenchmarksSpec(**layer(args, _BENCH_FLAGS, {"validate.benchmarks": given})["validate.benchmarks"])
    except ValidationError as e:
        raise UsageError("; ".join(err["msg"] for err in e.errors())) from None
    try:
        result = score_run_folder(args.run_dir, settings, args.base)
    except ValueError as e:
        return failed("eval", f"refused: {e}")
    except BenchmarkError as e:
        return failed("eval", f"failed: {e}")
    table = rows(result)
    if args.json:
        print(json.dumps([r.model_dump() | {"diff": r.diff} for r in table], indent=2))
        return 0
    for r in table_rows(table):
        print(
            f"{r['task']:<24} {r['metric']:<16} base {r['base'] or '-':>8}  tuned {r['tuned']:>8}  "
            f"diff {r['diff'] or '-':>8}  stderr {r['stderr'] or '-':>8}"
        )
    print(f"({result.seconds:.1f} s{', base cached' if result.base and result.base.cached else ''})")
    return 0

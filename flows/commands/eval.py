"""`nightloom eval RUN_DIR --data FILE.jsonl [--seq-len N] [--json]`: held-out loss of a run's latest checkpoint."""

from __future__ import annotations

import json

from flows.commands.common import UsageError, failed, require_file, require_run_dir


def register(sub) -> None:
    p = sub.add_parser("eval", help="score a run's latest checkpoint on a JSONL file (mean NLL per token, ppl)")
    p.add_argument("run_dir", help="the run folder (holds job*.json and checkpoints/)")
    p.add_argument(
        "--data",
        required=True,
        help="JSONL file of documents ({'text': ...} per line); for a train.task sft run, chat records (messages, "
        "conversations or instruction/output), scored on their assistant tokens only",
    )
    p.add_argument("--seq-len", type=int, default=None, help="tokens per document scored (default: the run's)")
    p.add_argument("--json", action="store_true", help="print {loss, tokens, ppl, ...} as JSON")
    p.set_defaults(func=run)


def check_args(args) -> None:
    """The run folder, the data file and --seq-len, checked before torch is imported (seconds): UsageError."""
    require_run_dir(args.run_dir)
    require_file(args.data, "--data file")
    if args.seq_len is not None and args.seq_len < 2:
        raise UsageError("--seq-len must be >= 2")


def run(args) -> int:
    check_args(args)
    from nightloom.tokenizer import TokenizerError
    from nightloom.train.evaluate import EvalError, evaluate_run

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

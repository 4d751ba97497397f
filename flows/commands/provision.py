"""`nightloom provision SPEC --check [--json]`: acquire + preflight + release, and print the per-node report."""

from __future__ import annotations

from flows.commands.common import failed, load_spec_file, spec_invalid
from nightloom.provision import get_provider
from nightloom.provision.base import ProvisionError
from nightloom.provision.check import check, format_check
from nightloom.spec import SpecError


def register(sub) -> None:
    p = sub.add_parser("provision", help="check a cluster: acquire, preflight every node, release")
    p.add_argument("spec", help="path to the run spec YAML")
    p.add_argument(
        "--check",
        action="store_true",
        required=True,
        help="acquire + preflight + release (the only mode: training goes through `run`)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def _provider(spec):
    if spec.cluster.provider.kind == "ssh" and spec.cluster.provider.key_secret:
        from tasks.provision import make_provider  # the key lives in a Prefect Secret block

        return make_provider(spec)
    return get_provider(spec)


def run(args) -> int:
    try:
        spec = load_spec_file(args.spec)
        provider = _provider(spec)
    except SpecError as e:
        return spec_invalid(e)
    except ProvisionError as e:
        return failed("provision", str(e))
    res = check(provider)
    print(res.model_dump_json(indent=2) if args.json else format_check(res))
    return 0 if res.ok else 1

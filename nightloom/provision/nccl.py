"""NCCL/InfiniBand environment rendered from `spec.cluster.nccl` and validated before any node is rented.

Unset fields are left to NCCL's own defaults; NCCL_DEBUG is off unless asked for. Value syntax follows the
NCCL environment-variable documentation: NCCL_IB_HCA / NCCL_SOCKET_IFNAME take a comma-separated list of
interface names, optionally `name:port` for HCAs, prefixed by `^` (exclude) and/or `=` (exact match instead
of prefix match), e.g. `=mlx5_0:1,mlx5_1:1` or `^docker,lo`.
"""

from __future__ import annotations

import re

from nightloom.provision.base import ProvisionError

_IFACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_HCA = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}(:[0-9]{1,3})?")


class NCCLConfigError(ProvisionError):
    """An NCCL setting NCCL would misread; the message names the spec field and the value."""


def _split_prefix(value: str) -> tuple[str, str]:
    """('^=', 'mlx5_0,...'): NCCL accepts '^' (exclude) then '=' (exact match), in that order."""
    prefix = ""
    if value.startswith("^"):
        prefix, value = "^", value[1:]
    if value.startswith("="):
        prefix, value = prefix + "=", value[1:]
    return prefix, value


def _check_list(field: str, value: str, item: re.Pattern) -> str:
    if value != value.strip() or not value:
        raise NCCLConfigError(f"cluster.nccl.{field}: empty or padded value {value!r}")
    prefix, body = _split_prefix(value)
    names = body.split(",")
    for name in names:
        if not item.fullmatch(name):
            raise NCCLConfigError(
                f"cluster.nccl.{field}: {name!r} in {value!r} is not an interface name"
                f"{' (optionally :port)' if item is _HCA else ''}; expected e.g. "
                f"{'=mlx5_0:1,mlx5_1:1' if item is _HCA else 'eth0 or ^docker,lo'}"
            )
    if len(set(names)) != len(names):
        raise NCCLConfigError(f"cluster.nccl.{field}: duplicate names in {value!r}")
    return prefix + ",".join(names)


def render_nccl_env(nccl) -> dict[str, str]:
    """Env vars for every rank from a NCCLSpec; raises NCCLConfigError naming the field on a bad value."""
    env: dict[str, str] = {}
    if nccl.ib_disable is not None:
        env["NCCL_IB_DISABLE"] = "1" if nccl.ib_disable else "0"
    if nccl.p2p_disable is not None:
        env["NCCL_P2P_DISABLE"] = "1" if nccl.p2p_disable else "0"
    if nccl.ib_hca is not None:
        if nccl.ib_disable:
            raise NCCLConfigError("cluster.nccl.ib_hca: set while cluster.nccl.ib_disable is true (HCAs unused)")
        env["NCCL_IB_HCA"] = _check_list("ib_hca", nccl.ib_hca, _HCA)
    if nccl.socket_ifname is not None:
        env["NCCL_SOCKET_IFNAME"] = _check_list("socket_ifname", nccl.socket_ifname, _IFACE)
    if nccl.buffsize is not None:
        if nccl.buffsize & (nccl.buffsize - 1):
            raise NCCLConfigError(f"cluster.nccl.buffsize: {nccl.buffsize} is not a power of two (NCCL default 4 MiB)")
        env["NCCL_BUFFSIZE"] = str(nccl.buffsize)
    if nccl.ib_gid_index is not None:
        if nccl.ib_disable:
            raise NCCLConfigError("cluster.nccl.ib_gid_index: set while cluster.nccl.ib_disable is true")
        env["NCCL_IB_GID_INDEX"] = str(nccl.ib_gid_index)
    if nccl.debug != "OFF":
        env["NCCL_DEBUG"] = nccl.debug
    return env


def nccl_table(env: dict[str, str]) -> list[dict[str, str]]:
    """Rows for the run artifact (every NCCL_* variable; the rest are not shown)."""
    return [{"variable": k, "value": v} for k, v in sorted(env.items()) if k.startswith("NCCL_")]

"""NCCL/IB environment: rendered from the spec, validated with the field named."""

import pytest

from nightloom.provision.nccl import NCCLConfigError, nccl_table, render_nccl_env
from nightloom.spec import NCCLSpec


def test_defaults_leave_everything_to_nccl_and_debug_off():
    assert render_nccl_env(NCCLSpec()) == {}


def test_full_render():
    env = render_nccl_env(
        NCCLSpec(
            ib_disable=False,
            p2p_disable=True,
            ib_hca="=mlx5_0:1,mlx5_1:1",
            socket_ifname="^docker,lo",
            buffsize=8 * 2**20,
            ib_gid_index=3,
            debug="INFO",
        )
    )
    assert env == {
        "NCCL_IB_DISABLE": "0",
        "NCCL_P2P_DISABLE": "1",
        "NCCL_IB_HCA": "=mlx5_0:1,mlx5_1:1",
        "NCCL_SOCKET_IFNAME": "^docker,lo",
        "NCCL_BUFFSIZE": str(8 * 2**20),
        "NCCL_IB_GID_INDEX": "3",
        "NCCL_DEBUG": "INFO",
    }
    assert [r["variable"] for r in nccl_table({**env, "OMP_NUM_THREADS": "1"})] == sorted(env)


@pytest.mark.parametrize("hca", ["^=mlx5_0", "=mlx5_0", "mlx5", "^mlx5_2"])
def test_hca_prefixes_kept(hca):
    assert render_nccl_env(NCCLSpec(ib_hca=hca))["NCCL_IB_HCA"] == hca


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("ib_hca", "==mlx5_0", "ib_hca"),  # '=' twice: NCCL would look for an HCA named '=mlx5_0'
        ("ib_hca", "=mlx5_0, mlx5_1", "ib_hca"),  # a space inside the list
        ("ib_hca", "mlx5_0;rm -rf /", "ib_hca"),
        ("ib_hca", "=mlx5_0,mlx5_0", "duplicate"),
        ("socket_ifname", "eth0:1", "socket_ifname"),
        ("socket_ifname", "$(reboot)", "socket_ifname"),
        ("buffsize", 3_000_000, "power of two"),
    ],
)
def test_bad_values_name_the_field(field, value, needle):
    with pytest.raises(NCCLConfigError, match=needle) as e:
        render_nccl_env(NCCLSpec(**{field: value}))
    assert "cluster.nccl." in str(e.value)


def test_hca_with_ib_disabled_is_a_contradiction():
    with pytest.raises(NCCLConfigError, match="ib_disable"):
        render_nccl_env(NCCLSpec(ib_disable=True, ib_hca="=mlx5_0"))

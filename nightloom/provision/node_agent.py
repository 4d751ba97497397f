"""Runs ON a node (stdlib only; sent as `python -c SOURCE CMD JSON`): prepare the environment, probe the node.

prepare: a venv keyed by the hash of its requirements under WORKDIR/.nightloom/envs/KEY, layered on the
  node's base interpreter (its site-packages and PYTHONPATH go into a .pth, so the node's torch/CUDA stack is
  reused and never reinstalled); extra requirements are pip-installed once. A `ready.json` marker written
  last makes a warm node ready in one round trip. Created in a temp folder and renamed, so a crash never
  leaves a half-built env that looks ready.
probe: python/torch versions, GPUs via nvidia-smi (when present), free disk, the node's clock.
Each prints one JSON line prefixed with `NIGHTLOOM_JSON `.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time

_T_START = time.time()  # the node's clock, read before anything slow (clock-skew check)


def _emit(obj):
    print("NIGHTLOOM_JSON " + json.dumps(obj), flush=True)


def _base_paths():
    """The base interpreter's import path minus the standard library (site-packages, PYTHONPATH entries)."""
    std = {os.path.realpath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib")}
    out = []
    for p in sys.path:
        if not p or not os.path.isdir(p) or p.endswith(".zip"):
            continue
        rp = os.path.realpath(p)
        if rp in std or any(rp.startswith(s + os.sep + "lib-dynload") for s in std) or rp == os.getcwd():
            continue
        if rp not in out:
            out.append(rp)
    return out


def prepare(args):
    t0 = time.time()
    workdir = os.path.abspath(os.path.expanduser(args["workdir"]))
    os.makedirs(workdir, exist_ok=True)
    env_dir = os.path.join(workdir, ".nightloom", "envs", args["key"])
    marker = os.path.join(env_dir, "ready.json")
    if os.path.isfile(marker):
        with open(marker) as f:
            info = json.load(f)
        info.update(warm=True, seconds=time.time() - t0, workdir=workdir)
        return info
    import venv

    os.makedirs(os.path.dirname(env_dir), exist_ok=True)
    tmp = env_dir + ".tmp%d" % os.getpid()
    shutil.rmtree(tmp, ignore_errors=True)
    venv.EnvBuilder(with_pip=False, symlinks=True, clear=True).create(tmp)
    ver = "python%d.%d" % sys.version_info[:2]
    site = os.path.join(tmp, "lib", ver, "site-packages")
    with open(os.path.join(site, "_nightloom_base.pth"), "w") as f:
        f.write("\n".join(_base_paths()) + "\n")
    reqs = args.get("requirements") or []
    if reqs:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "--python",
                os.path.join(tmp, "bin", "python"),
                "install",
                "--quiet",
                "--disable-pip-version-check",
                *reqs,
            ],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError("pip install failed: " + (r.stderr or r.stdout)[-400:])
    info = {
        "key": args["key"],
        "python": os.path.join(env_dir, "bin", "python"),
        "requirements": reqs,
        "base_python": sys.executable,
        "created_unix": time.time(),
    }
    with open(os.path.join(tmp, "ready.json.tmp"), "w") as f:
        json.dump(info, f)
    os.replace(os.path.join(tmp, "ready.json.tmp"), os.path.join(tmp, "ready.json"))
    try:
        os.replace(tmp, env_dir)
    except OSError:  # another preparer won the race: use theirs
        shutil.rmtree(tmp, ignore_errors=True)
    info.update(warm=False, seconds=time.time() - t0, workdir=workdir)
    return info


def probe(args):
    out = {
        "python": "%d.%d.%d" % sys.version_info[:3],
        "executable": sys.executable,
        "torch": None,
        "torch_error": None,
        "cuda_devices": None,
        "gpus": None,
        "gpu_error": None,
    }
    try:
        import torch

        out["torch"] = torch.__version__
        out["cuda_devices"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as e:  # noqa: BLE001 - reported, judged by the orchestrator
        out["torch_error"] = f"{type(e).__name__}: {e}"
    smi = shutil.which("nvidia-smi")
    if smi:
        r = subprocess.run(
            [smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if r.returncode == 0:
            out["gpus"] = [
                dict(zip(("name", "driver", "memory_mib"), (x.strip() for x in line.split(","))))
                for line in r.stdout.strip().splitlines()
                if line.strip()
            ]
        else:
            out["gpu_error"] = "nvidia-smi exited %d: %s" % (r.returncode, (r.stderr or r.stdout).strip()[-200:])
    path = os.path.abspath(os.path.expanduser(args.get("workdir", ".")))
    while not os.path.exists(path):
        path = os.path.dirname(path)
    out["free_disk_gib"] = shutil.disk_usage(path).free / 2**30
    out["time_unix"] = _T_START
    return out


def main(argv):
    cmd, args = argv[0], json.loads(argv[1])
    try:
        _emit({"ok": True, **({"prepare": prepare, "probe": probe}[cmd](args))})
    except Exception as e:  # noqa: BLE001 - one JSON line either way
        _emit({"ok": False, "error": f"{type(e).__name__}: {e}"})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

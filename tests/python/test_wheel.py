"""The wheel (issue #17, item 10): ``maturin build --release`` gives one abi3 manylinux wheel, and that
wheel, installed into a fresh virtual environment beside vLLM, runs P/D.

The test builds the wheel (reusing the release build that ``maturin develop --release`` left in
``target/``: only the packaging is new), checks its name and tags (``cp310-abi3``, a ``manylinux``
platform tag), its files, and that the native module needs nothing outside the manylinux allow-list (NIXL
is not linked: the package finds ``libnixl_capi.so`` at run time, docs/vllm.md "Installing the wheel").
It then makes a fresh venv (``python -m venv --without-pip``, no system site-packages), installs the
wheel into it with pip (``--no-deps --no-index``), and makes vLLM importable there the way an operator
who installs kvpush next to an existing vLLM would have it: a ``.pth`` file that adds the vLLM venv's
site-packages *after* the fresh venv's own (``site.addsitedir``). From that interpreter it checks that
``kvpush``, ``kvpush._native`` and ``kvpush.vllm`` come from the wheel (not from the checkout, which the
shared venv's editable install also puts on ``sys.path``), that vLLM's connector factory resolves
``KVPushConnector`` from it, and runs the native P/D push over NIXL of
tests/python/test_native_layerwise.py (two workers, every byte on D compared with P's).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Libraries the manylinux policies allow a wheel's extension to need (PEP 599/600), that the native module
# may link.
MANYLINUX_LIBS = {"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1",
                  "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1", "libgcc_s.so.1", "libstdc++.so.6"}  # fmt: skip
WHEEL_NAME = re.compile(r"kvpush-(?P<version>[^-]+)-cp310-abi3-(?P<platform>manylinux_\d+_\d+_(?P<arch>\w+?)(\..+)?)\.whl")


def run(argv: list[str], what: str, timeout_s: float = 900, **kw: object) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, **kw)  # type: ignore[call-overload]
    assert r.returncode == 0, f"{what} failed ({r.returncode}): {' '.join(map(str, argv))}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return r


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    maturin = shutil.which("maturin")
    if maturin is None:
        pytest.skip("maturin is not on PATH (scripts/python.sh installs it)")
    out = tmp_path_factory.mktemp("wheels")
    t0 = time.monotonic()
    run([maturin, "build", "--release", "--quiet", "-o", str(out)], "maturin build --release", cwd=REPO)
    wheels = sorted(out.glob("*.whl"))
    print(f"\n  maturin build --release: {[w.name for w in wheels]} in {time.monotonic() - t0:.1f} s")
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_the_wheel_is_abi3_manylinux_with_the_package_and_no_nixl_linked(wheel: Path, tmp_path: Path) -> None:
    m = WHEEL_NAME.fullmatch(wheel.name)
    assert m, f"{wheel.name} is not kvpush-<version>-cp310-abi3-manylinux_<glibc>_<arch>.whl"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for f in ("kvpush/__init__.py", "kvpush/vllm.py", "kvpush/_layouts.py", "kvpush/_native.abi3.so"):
            assert f in names, f"{f} not in {wheel.name}: {sorted(names)}"
        meta = next(n for n in names if n.endswith(".dist-info/WHEEL"))
        tags = [line.split(":", 1)[1].strip() for line in z.read(meta).decode().splitlines() if line.startswith("Tag:")]
        z.extract("kvpush/_native.abi3.so", tmp_path)
    assert tags and all(t.startswith("cp310-abi3-manylinux") for t in tags), tags
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf (binutils) is not installed")
    dynamic = run([readelf, "-d", str(tmp_path / "kvpush/_native.abi3.so")], "readelf -d").stdout
    needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic))
    print(f"  {wheel.name}: tags {tags}, NEEDED {sorted(needed)}")
    assert needed and needed <= MANYLINUX_LIBS, f"links outside the manylinux allow-list: {sorted(needed - MANYLINUX_LIBS)}"


def fresh_venv(root: Path, wheel: Path) -> Path:
    """A venv without system site-packages, the wheel installed, vLLM's site-packages after its own."""
    venv = root / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], "python -m venv")
    python = venv / "bin" / "python"
    own = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], "purelib").stdout.strip())
    vllm_site = sysconfig.get_paths()["purelib"]  # this interpreter's: the venv that has vLLM
    (own / "zz-vllm-beside.pth").write_text(f"import site; site.addsitedir({vllm_site!r})\n")
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "--quiet", str(wheel)],
        "pip install the wheel")  # fmt: skip
    return python


CHECK = """
import sys, kvpush, kvpush._native, kvpush.vllm
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
cfg = KVTransferConfig(kv_connector="KVPushConnector", kv_connector_module_path="kvpush.vllm", kv_role="kv_producer")
cls = KVConnectorFactory.get_connector_class(cfg)
print(kvpush.__file__); print(kvpush._native.__file__); print(sys.modules[cls.__module__].__file__)
print(KVConnectorFactory.supports_hma_config(cfg))
"""


def test_the_wheel_runs_pd_in_a_fresh_venv_beside_vllm(wheel: Path, tmp_path: Path) -> None:
    t0 = time.monotonic()
    python = fresh_venv(tmp_path, wheel)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    out = run([str(python), "-c", CHECK], "importing kvpush from the wheel", env=env, cwd=tmp_path).stdout.split()
    print(f"\n  fresh venv {python.parent.parent} ready in {time.monotonic() - t0:.1f} s; kvpush from {out[0]}")
    site = str(python.parent.parent / "lib")
    for f in out[:3]:
        assert f.startswith(site), f"{f} is not the wheel's copy under {site}"
    assert out[3] == "True", "vLLM does not see KVPushConnector as SupportsHMA"
    # The native P/D push over NIXL, every byte checked, run by the fresh interpreter.
    t1 = time.monotonic()
    r = run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA",
         str(REPO / "tests/python/test_native_layerwise.py")],
        "native P/D push from the wheel", env=env, cwd=REPO,
    )  # fmt: skip
    print(f"  test_native_layerwise.py from the wheel in {time.monotonic() - t1:.1f} s: {r.stdout.strip().splitlines()[-1]}")
    tests = len(re.findall(r"^def test_", (REPO / "tests/python/test_native_layerwise.py").read_text(), re.M))
    assert re.search(rf"\b{tests} passed\b", r.stdout) and "skipped" not in r.stdout and "failed" not in r.stdout, (
        r.stdout[-3000:]
    )

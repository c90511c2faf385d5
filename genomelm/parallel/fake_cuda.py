"""Run a function in a process where fake CUDA tensors behave as on a GPU machine, on a CPU-only torch build.

torch's `FakeTensorMode` already makes CUDA tensors without a GPU (shapes, dtypes, devices; no data). Two
pieces of the CUDA runtime are missing on a CPU build, and both sit below Python: the device guard the
bindings of `copy_`, indexing and `.to()` take, and the CUDA hooks the autograd engine asks for streams.
`fake_cuda.cpp` registers stand-ins for both (torch's own `FakeGuardImpl`; hooks that say CUDA is present).
torch reads its CUDA hooks once, early, so the library must be loaded before `import torch`:
`run_on_fake_cuda` starts a fresh interpreter that runs this file on its own (its top level imports no torch,
and no package whose `__init__` does), loads the library, then torch, runs the pickled call and sends back its
result or its exception.

The library is compiled on first use with the C++ compiler torch's extensions use (about 5 s), into
`~/.cache/genomelm/` (or `$GENOMELM_CACHE`), keyed by the source and the torch version. In that process only
fake tensors may be CUDA tensors: a real CUDA allocation fails as it does without the library.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import pickle
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).with_name("fake_cuda.cpp")
LIBRARY_ENV = "GENOMELM_FAKE_CUDA_LIB"
_BOOT = (  # this file as a plain module (the genomelm.parallel package imports torch), then `_serve`
    "import importlib.util, sys; "
    "spec = importlib.util.spec_from_file_location('fake_cuda_boot', sys.argv[1]); "
    "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
    "module._serve(*map(module.Path, sys.argv[2:]))"
)


class FakeCudaError(RuntimeError):
    """The fake-CUDA process could not be built, started, or finish in time."""

    exit_code = 1  # the machine's failure (`genomelm.run.failures`)


def _torch_lib_dir() -> Path:
    """torch's shared libraries, found without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise FakeCudaError("torch is not installed in this interpreter")
    return Path(spec.submodule_search_locations[0]) / "lib"


def fake_cuda_library() -> Path:
    """The compiled stand-in library (built once per source and torch version)."""
    import torch
    from torch.utils.cpp_extension import include_paths

    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + torch.__version__.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("GENOMELM_CACHE", Path.home() / ".cache" / "genomelm"))
    library = cache / f"fake_cuda-{key}.so"
    if library.exists():
        return library
    cache.mkdir(parents=True, exist_ok=True)
    compiler = os.environ.get("CXX", "c++")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    partial = library.with_name(f"{library.name}.{os.getpid()}.tmp")
    command = [
        compiler,
        "-shared",
        "-fPIC",
        "-O1",
        "-std=c++17",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{path}" for path in include_paths()),
        str(SOURCE),
        "-o",
        str(partial),
        f"-L{_torch_lib_dir()}",
        "-lc10",
        "-ltorch_cpu",
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except FileNotFoundError as error:
        raise FakeCudaError(
            f"the CUDA simulation needs a C++ compiler ({compiler!r} not found): install g++ "
            "(apt-get install g++) or set CXX"
        ) from error
    if done.returncode:
        partial.unlink(missing_ok=True)
        raise FakeCudaError(f"compiling {SOURCE} failed:\n{done.stderr[-4000:]}")
    os.replace(partial, library)
    return library


def run_on_fake_cuda(fn: Callable[..., Any], *args: Any, timeout_s: float = 600.0, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) in a fresh fake-CUDA process; its return value, or its exception re-raised here
    (with the process's traceback as the cause). fn, its arguments and its result must pickle."""
    library = fake_cuda_library()
    with tempfile.TemporaryDirectory(prefix="genomelm-fake-cuda-") as folder:
        call, answer = Path(folder) / "call.pkl", Path(folder) / "answer.pkl"
        call.write_bytes(pickle.dumps((fn, args, kwargs)))
        env = {**os.environ, LIBRARY_ENV: str(library), "PYTHONPATH": os.pathsep.join(sys.path)}
        try:
            done = subprocess.run(
                [sys.executable, "-c", _BOOT, str(Path(__file__).resolve()), str(call), str(answer)],
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired as error:
            raise FakeCudaError(f"the fake-CUDA process ran past {timeout_s} s") from error
        if not answer.exists():
            raise FakeCudaError(
                f"the fake-CUDA process exited with {done.returncode}:\n{done.stderr[-4000:]}"
            )
        outcome = pickle.loads(answer.read_bytes())
    if outcome[0] == "ok":
        return outcome[1]
    _, error, trace = outcome
    raise error from FakeCudaError(f"in the fake-CUDA process:\n{trace}")


def _serve(call: Path, answer: Path) -> None:
    """The process's side: load the stand-ins, then torch, then run the call."""
    for name in ("libc10.so", "libtorch_cpu.so"):
        ctypes.CDLL(str(_torch_lib_dir() / name), mode=ctypes.RTLD_GLOBAL)
    ctypes.CDLL(os.environ[LIBRARY_ENV], mode=ctypes.RTLD_GLOBAL)
    import torch

    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None or accelerator.type != "cuda":
        raise FakeCudaError("the CUDA stand-ins did not register (was torch imported before them?)")
    fn, args, kwargs = pickle.loads(call.read_bytes())
    try:
        outcome: tuple = ("ok", fn(*args, **kwargs))
    except Exception as error:  # sent back to the caller, which re-raises it
        outcome = ("error", error, traceback.format_exc())
    partial = answer.with_suffix(".tmp")
    try:
        partial.write_bytes(pickle.dumps(outcome))
    except Exception:  # an unpicklable result or exception: send its text (as a builtin error type)
        text = f"{outcome[1]!r}" if outcome[0] == "error" else "the result does not pickle"
        trace = outcome[2] if outcome[0] == "error" else traceback.format_exc()
        partial.write_bytes(pickle.dumps(("error", RuntimeError(text), trace)))
    os.replace(partial, answer)

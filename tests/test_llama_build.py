"""A llama.cpp build for another CPU is refused with a RuntimeError, never run into a SIGILL.

check_llama_build compares the instruction sets llama.cpp reports as compiled in with
/proc/cpuinfo; load_llama and LlamaDecoder call it before anything runs llama.cpp's kernels.
scripts/llama_wheel.py keys install.sh's wheel cache by the CPU.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import specfast.bench.llama as llama_bench
import specfast.targets.llama_cpp.build as lc
import specfast.targets.llama_cpp.decoder as lcd

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "llama_wheel.py"

# What an AVX-512 build printed on 2026-11-30 (llama_print_system_info).
AVX512_BUILD = (
    "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX_VNNI = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | "
    "BMI2 = 1 | AVX512 = 1 | AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | "
    "LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | "
)
# An AVX2-only CPU's flags, as /proc/cpuinfo spells them.
AVX2_CPU = {"fpu", "sse", "sse2", "pni", "ssse3", "sse4_1", "sse4_2", "avx", "avx2", "fma"}
AVX2_CPU |= {"f16c", "bmi1", "bmi2", "avx_vnni"}
AVX512_CPU = AVX2_CPU | {"avx512f", "avx512bw", "avx512vl", "avx512vbmi", "avx512_vnni"}
AVX512_CPU |= {"avx512_bf16"}


def load_script():
    spec = importlib.util.spec_from_file_location("llama_wheel", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ----------------------------------------------------------------------------
# the check on given strings


def test_build_for_avx512_refused_on_avx2_cpu():
    with pytest.raises(RuntimeError) as e:
        lc.check_llama_build(AVX512_BUILD, AVX2_CPU)
    msg = str(e.value)
    for name in ("AVX512 (avx512f)", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16"):
        assert name in msg
    assert "AVX2 " not in msg and "AVX_VNNI" not in msg  # what the CPU has is not named
    assert "scripts/install.sh" in msg and "--no-cache-dir --force-reinstall" in msg


def test_build_for_avx512_passes_with_the_flags():
    # The negative control of the test above: the same build on a CPU that has what it needs.
    lc.check_llama_build(AVX512_BUILD, AVX512_CPU)


def test_only_the_missing_flag_is_named():
    with pytest.raises(RuntimeError, match=r"AVX512_BF16 \(avx512_bf16\)\.") as e:
        lc.check_llama_build(AVX512_BUILD, AVX512_CPU - {"avx512_bf16"})
    assert "AVX512_VNNI" not in str(e.value)


def test_kernel_spellings():
    # /proc/cpuinfo spells SSE3 "pni" and AVX512_VBMI "avx512vbmi" (no underscore).
    lc.check_llama_build("CPU : SSE3 = 1 | AVX512_VBMI = 1 | ", {"pni", "avx512vbmi"})
    with pytest.raises(RuntimeError, match="SSE3"):
        lc.check_llama_build("CPU : SSE3 = 1 | ", {"sse3"})
    with pytest.raises(RuntimeError, match="AMX_INT8 \\(amx_tile\\)"):
        lc.check_llama_build("CPU : AMX_INT8 = 1 | ", {"amx_int8"})


def test_bad_argument_types():
    with pytest.raises(TypeError, match="set of /proc/cpuinfo flag names"):
        lc.check_llama_build(AVX512_BUILD, "avx512f avx2")  # a str would match substrings
    with pytest.raises(TypeError, match="decode"):
        lc.check_llama_build(AVX512_BUILD.encode(), AVX512_CPU)


def test_features_off_or_not_x86_are_ignored():
    info = "CPU : AVX512 = 0 | NEON = 1 | LLAMAFILE = 1 | REPACK = 1 | \nCUDA : ARCHS = 890 | "
    assert lc.build_instructions(info) == []
    lc.check_llama_build(info, set())


# ----------------------------------------------------------------------------
# the real build, read in a child process


def test_this_build_fits_this_cpu():
    pytest.importorskip("llama_cpp")
    if lc.read_cpu_flags() is None:
        pytest.skip("the check runs on Linux x86-64 only")
    lc.check_llama_build()
    # Not vacuous: the report names instruction sets, and a CPU without them is refused.
    assert "AVX2" in lc.build_instructions(lc.llama_system_info())
    with pytest.raises(RuntimeError, match="AVX2"):
        lc.check_llama_build(cpu_flags=set())


def test_report_is_read_in_a_child(monkeypatch):
    # Reading the report runs ggml_cpu_init, which executes the build's own (AVX-512) code, so
    # this process must never call it: a broken in-process call fails here.
    llama_cpp = pytest.importorskip("llama_cpp")

    def crash():
        raise AssertionError("llama_print_system_info ran in the calling process")

    monkeypatch.setattr(llama_cpp, "llama_print_system_info", crash)
    assert "AVX2" in lc.build_instructions(lc.llama_system_info())


def test_child_killed_by_sigill_is_a_runtime_error(monkeypatch):
    pytest.importorskip("llama_cpp")
    monkeypatch.setattr(lc, "_PROBE", "import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    with pytest.raises(RuntimeError, match=r"SIGILL.*scripts/install\.sh"):
        lc.llama_system_info()
    with pytest.raises(RuntimeError, match="SIGILL"):
        lc.check_llama_build(cpu_flags=AVX512_CPU)
    # Control: the same probe path with a report that fits.
    monkeypatch.setattr(lc, "_PROBE", f"import sys; sys.stdout.write({AVX512_BUILD!r})")
    lc.check_llama_build(cpu_flags=AVX512_CPU)


def test_an_amx_pass_that_crashes_names_the_compiler_fix(monkeypatch):
    # The report printed, then the child died: the AMX kernels, not the instruction sets.
    pytest.importorskip("llama_cpp")
    kill = "import os, signal; os.kill(os.getpid(), signal.SIGILL)"
    amx_report = "CPU : AVX2 = 1 | AMX_INT8 = 1 | "
    monkeypatch.setattr(lc, "_PROBE", f"import sys; print({amx_report!r}, flush=True); {kill}")
    with pytest.raises(RuntimeError, match=r"AMX kernels killed.*SIGILL.*-fno-dse"):
        lc.llama_system_info()
    # Control: a crash before any report is a build for another CPU, not the AMX fix.
    monkeypatch.setattr(lc, "_PROBE", kill)
    with pytest.raises(RuntimeError, match="built for another CPU") as e:
        lc.llama_system_info()
    assert "-fno-dse" not in str(e.value)


def test_the_probe_runs_a_batched_pass_only_on_amx_builds(tmp_path):
    # _PROBE's own logic, with a stand-in llama_cpp module that records what the child ran.
    fake = tmp_path / "llama_cpp.py"
    for report, passes in (("CPU : AVX2 = 1 | AMX_INT8 = 1 | ", 1), ("CPU : AVX2 = 1 | ", 0)):
        fake.write_text(
            f"def llama_print_system_info(): return {report.encode()!r}\n"
            "class Llama:\n"
            "    def __init__(self, path, **kw): print('LOAD', path)\n"
            "    def eval(self, ids): print('EVAL', len(ids))\n"
        )
        code = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); {lc._PROBE}"
        out = subprocess.run(
            [sys.executable, "-c", code, "m.gguf"], capture_output=True, text=True, check=True
        ).stdout
        assert out.startswith(report)
        assert out.count("LOAD m.gguf") == passes and out.count("EVAL 40") == passes


def test_child_that_fails_otherwise_warns_and_skips(monkeypatch):
    pytest.importorskip("llama_cpp")
    monkeypatch.setattr(lc, "_PROBE", "raise SystemExit('no report here')")
    with pytest.warns(RuntimeWarning, match="no report here"):
        assert lc.llama_system_info() is None


# ----------------------------------------------------------------------------
# where specfast calls it


def refuse():
    raise RuntimeError("built for another CPU")


@pytest.fixture
def built(monkeypatch) -> list:
    """The keyword arguments of every Llama built, with Llama a fake and the check refusing."""
    llama_cpp = pytest.importorskip("llama_cpp")
    calls: list = []
    monkeypatch.setattr(llama_cpp, "Llama", lambda **kw: calls.append(kw) or "a llama")
    monkeypatch.setattr(lcd, "check_llama_build", refuse)
    monkeypatch.setattr(llama_bench, "check_llama_build", refuse)
    return calls


def test_load_llama_checks_before_building_the_llama(monkeypatch, built, smollm_gguf):
    with pytest.raises(RuntimeError, match="another CPU"):
        lcd.load_llama(smollm_gguf)
    assert built == []
    # Control: with the check passing, the same call builds the (fake) Llama.
    monkeypatch.setattr(lcd, "check_llama_build", lambda: None)
    assert lcd.load_llama(smollm_gguf) == "a llama" and len(built) == 1


def test_bench_checks_before_building_its_llamas(monkeypatch, built, tmp_path):
    from specfast.bench.llama import load_llamas

    with pytest.raises(RuntimeError, match="another CPU"):
        load_llamas(tmp_path / "m.gguf", ["llama.cpp-plain"], None)
    assert built == []
    monkeypatch.setattr(llama_bench, "check_llama_build", lambda: None)  # control
    assert load_llamas(tmp_path / "m.gguf", ["llama.cpp-plain"], None) == {"target": "a llama"}


def test_llama_decoder_checks(monkeypatch):
    pytest.importorskip("llama_cpp")
    Llama = type("Llama", (), {"__module__": "llama_cpp.llama"})  # is_llama accepts it
    monkeypatch.setattr(lcd, "check_llama_build", refuse)
    with pytest.raises(RuntimeError, match="another CPU"):
        lcd.LlamaDecoder(Llama())
    # Control: past the check, the fake fails on what a real Llama has.
    monkeypatch.setattr(lcd, "check_llama_build", lambda: None)
    with pytest.raises(AttributeError):
        lcd.LlamaDecoder(Llama())


# ----------------------------------------------------------------------------
# install.sh's wheel cache (scripts/llama_wheel.py)


def test_wheel_key_depends_on_the_flag_set_not_its_order():
    w = load_script()
    flags = sorted(AVX512_CPU)
    assert w.wheel_key(flags) == w.wheel_key(reversed(flags)) == w.wheel_key(set(flags))
    assert len(w.wheel_key(flags)) == 12
    assert w.wheel_key(AVX2_CPU) != w.wheel_key(AVX512_CPU)
    assert w.wheel_key(AVX512_CPU) != w.wheel_key(AVX512_CPU - {"avx512_bf16"})
    # Flags that do not change the build (hypervisor, mitigations) do not change the key.
    assert w.wheel_key(AVX2_CPU | {"hypervisor", "md_clear"}) == w.wheel_key(AVX2_CPU)
    assert w.wheel_key(AVX2_CPU, "-DGGML_NATIVE=OFF") != w.wheel_key(AVX2_CPU)


def test_wheel_status_compares_the_libraries(tmp_path):
    w = load_script()
    record = "llama_cpp/lib/libggml-cpu.so,sha256=aaa,10\nllama_cpp/__init__.py,sha256=b,2\n"
    wheel = tmp_path / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("llama_cpp_python-0.3.36.dist-info/RECORD", record)
    assert w.wheel_status(wheel, record) == "same"
    # pip rewrites RECORD's own line and scripts; only the libraries decide.
    assert w.wheel_status(wheel, record + "../../bin/x,sha256=c,1\n") == "same"
    assert w.wheel_status(wheel, record.replace("aaa", "zzz")) == "different"
    assert w.wheel_status(wheel, None) == "absent"


def test_check_of_an_unimportable_build_is_no_pass(tmp_path):
    """install.sh keeps a wheel only when `check` prints "fits". A llama_cpp whose import fails
    (a --no-deps install without diskcache, as a new machine had) is "unchecked", not a pass."""
    pytest.importorskip("llama_cpp")
    # The check's child puts site-packages first on its path, so a stand-in module would be
    # shadowed; sitecustomize (found on PYTHONPATH at startup) blocks the import instead.
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['diskcache'] = None\n")

    def check(pythonpath: str | None) -> str:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        run = subprocess.run(
            [sys.executable, str(SCRIPT), "check"], capture_output=True, text=True, env=env
        )
        return run.stdout.strip()

    assert check(str(tmp_path)) == "unchecked"
    assert check(None) == "fits"  # the control: the installed build, importable


# ----------------------------------------------------------------------------
# llama.cpp's AMX kernels beside torch's (crates/kernels/src/tiles.rs, tile_restorer)

MIXED = """
import sys, torch, llama_cpp
import specfast, specfast.targets.llama_cpp.decoder as lcd
if sys.argv[2] == "control":  # the decoder then never restores ggml's tile configuration
    lcd.tile_restorer = lambda: None
llama = llama_cpp.Llama(sys.argv[1], n_ctx=256, n_threads=2, n_threads_batch=2, verbose=False)
a, b = torch.randn(64, 576, dtype=torch.bfloat16), torch.randn(576, 1536, dtype=torch.bfloat16)
for _ in range(3):
    (a @ b).sum()  # oneDNN's AMX kernel configures the tiles, then releases them
    specfast.generate(llama, list(range(100, 140)), 8, num_speculative_tokens=4, ignore_eos=True)
print("ok")
"""


def test_llama_cpp_amx_passes_survive_torch_bf16_matmuls(smollm_gguf):
    # In a child: the known-wrong version dies with SIGILL, which would take pytest with it.
    pytest.importorskip("llama_cpp")
    if lc.tile_restorer() is None:
        pytest.skip("this llama.cpp build has no AMX kernels (or this CPU has no AMX)")

    def run(mode: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-c", MIXED, str(smollm_gguf), mode]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    fixed = run("restore")
    assert fixed.returncode == 0 and fixed.stdout.strip() == "ok", fixed.stderr[-2000:]
    control = run("control")
    assert control.returncode == -signal.SIGILL, (control.returncode, control.stderr[-500:])


def test_tile_restorer_is_cheap_and_idempotent():
    restore = lc.tile_restorer()
    if restore is None:
        pytest.skip("this llama.cpp build has no AMX kernels (or this CPU has no AMX)")
    for n in (1, 2, 4):
        restore(n)  # a wrong configuration would fault (#GP) here

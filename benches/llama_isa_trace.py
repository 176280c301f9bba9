"""Which AVX-512 (EVEX) instructions of the installed llama.cpp a piece of Python executes.

check_llama_build reads llama.cpp's build report in a child process because reading it runs
the build's own code. This is how that was established: every EVEX-encoded instruction of
libggml-cpu.so (found with objdump) gets a gdb breakpoint, the code runs under gdb, and the
hits are counted per exported function (the library is stripped, so a hit is named after the
exported symbol before it). A CPU without AVX-512 would die with SIGILL at the first hit.

    python benches/llama_isa_trace.py                       # the build report (the default)
    python benches/llama_isa_trace.py --code "import llama_cpp"
    python benches/llama_isa_trace.py --model               # control: one SmolLM2 token

On the -march=native build of 2026-11-30 (27,322 EVEX instructions; this VM's Xeon, avx512f/
vbmi/vnni/bf16), 2026-12-01, shared machine: `import llama_cpp` executed none of them;
llama_print_system_info() executed 32, all in ggml_cpu_init (zmm loads and stores); the control,
one token through SmolLM2, executed 211 across 17 functions (softmax, swiglu, ggml_vec_dot_f16,
quantize_row_q8_1, ggml_vec_dot_q4_1_q8_1, ...). Needs gdb and objdump; each run takes about 2
minutes, most of it inserting the breakpoints.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

PROBE = "import llama_cpp; llama_cpp.llama_print_system_info()"
MODEL = (
    "import llama_cpp, specfast; l = llama_cpp.Llama(model_path=str(specfast.default_model_path()),"
    " n_ctx=64, n_threads=1, n_threads_batch=1, verbose=False); l.eval(l.tokenize(b'Hello'))"
)
# Legacy prefixes that may precede an EVEX (0x62) prefix in 64-bit code.
PREFIXES = {"66", "67", "f2", "f3", "2e", "3e", "26", "64", "65", "36"}

GDB_SCRIPT = """
import gdb, json
offsets, names = json.load(open({table!r}))
hits = {{}}
class Hit(gdb.Breakpoint):
    def stop(self):
        hits[self.name_] = hits.get(self.name_, 0) + 1
        self.enabled = False  # once per site is enough to say "executed"
        return False
def loaded(ev):
    if "libggml-cpu.so" not in ev.new_objfile.filename:
        return
    maps = gdb.execute("info proc mappings", to_string=True).splitlines()
    base = next(int(m.split()[0], 16) for m in maps if "libggml-cpu.so" in m)
    for off, name in zip(offsets, names):
        bp = Hit("*%#x" % (base + off), internal=True)
        bp.name_ = name
gdb.events.new_objfile.connect(loaded)
gdb.events.exited.connect(lambda ev: print("HITS", json.dumps(hits)))
"""


def evex_sites(lib: Path) -> tuple[list[int], list[str]]:
    """Offsets of every EVEX-encoded instruction in lib, and the exported function of each."""
    dump = subprocess.run(["objdump", "-d", "-w", str(lib)], capture_output=True, text=True)
    offsets, names, fn = [], [], "?"
    for line in dump.stdout.splitlines():
        m = re.match(r"^[0-9a-f]+ <(.+?)(@@Base)?>:$", line)
        if m:
            fn = m.group(1)
            continue
        parts = line.split("\t")
        if len(parts) < 3 or fn.endswith("@plt"):
            continue
        code = [b for b in parts[1].split() if b not in PREFIXES]
        if code and code[0] == "62":
            offsets.append(int(parts[0].strip().rstrip(":"), 16))
            names.append(fn)
    return offsets, names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--code", default=PROBE, help="Python code to trace")
    ap.add_argument("--model", action="store_true", help="trace one token through SmolLM2")
    args = ap.parse_args()
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        sys.exit("needs llama-cpp-python")
    lib = Path(spec.origin).parent / "lib" / "libggml-cpu.so"
    offsets, names = evex_sites(lib)
    print(f"{lib}: {len(offsets)} EVEX instructions in {len(set(names))} exported functions")
    with tempfile.TemporaryDirectory() as tmp:
        table, script = Path(tmp) / "sites.json", Path(tmp) / "trace.py"
        table.write_text(json.dumps([offsets, names]))
        script.write_text(GDB_SCRIPT.format(table=str(table)))
        code = MODEL if args.model else args.code
        # Displaced stepping mis-relocates RIP-relative EVEX loads (a SIGSEGV); step in place.
        gdb = ["gdb", "-q", "-batch", "-ex", "set pagination off"]
        gdb += ["-ex", "set displaced-stepping off", "-ex", f"source {script}", "-ex", "run"]
        out = subprocess.run(
            [*gdb, "--args", str(Path(sys.executable).resolve()), "-c", code],
            capture_output=True,
            text=True,
        ).stdout
    found = [line for line in out.splitlines() if line.startswith("HITS ")]
    if not found:
        sys.exit("gdb did not finish:\n" + out[-2000:])
    hits = json.loads(found[-1][5:])
    print(f"{code}\n-> {sum(hits.values())} EVEX sites executed")
    for name, n in sorted(hits.items(), key=lambda kv: -kv[1]):
        print(f"  {n:6d}  {name}")


if __name__ == "__main__":
    main()

"""Record a benchmark run for the docs: ``docs/benchmarks/NAME.txt``.

    python docs/benchmarks/record.py NAME -- COMMAND [ARGS...]

Runs COMMAND from the repository root and writes a header (the command, the
date, the machine) followed by the command's standard output, verbatim. The
Benchmarks page of the site includes every such file as it is, so every number
on it comes from a recorded run. Fails (and writes nothing) if the command fails.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpus() -> str:
    """The machine's NVIDIA GPUs as ``nvidia-smi`` names them ("" where there is none)."""
    try:
        proc = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    names = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    return ", GPU " + " + ".join(names) if proc.returncode == 0 and names else ""


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isidentifier():
        print(__doc__, file=sys.stderr)
        return 2
    name, command = argv[0], argv[2:]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        print(
            f"record.py: command failed (exit {proc.returncode}); nothing written", file=sys.stderr
        )
        return proc.returncode
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = [
        f"$ {shlex.join(command)}",
        f"# recorded {now} on {_cpu()}, {os.cpu_count()} logical CPUs{_gpus()}, "
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}; "
        f"load average {load:.2f} at the start",
        "",
    ]
    out = HERE / f"{name}.txt"
    out.write_text("\n".join(header) + proc.stdout)
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

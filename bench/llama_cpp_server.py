"""llama-cpp-python's OpenAI server (`python -m llama_cpp.server`), runnable on this machine kind.

ggml's AMX kernels fault (ldtilecfg: general protection) in this machine kind's VM, which
advertises AMX; where the CPU lists amx_tile, every model loads without extra buffer types, so
ggml runs its plain CPU kernels as it does on CPUs without AMX (bench_core.py does the same).
Takes llama_cpp.server's own flags:

    .venv/bin/python bench/llama_cpp_server.py --model M.gguf --port 8001 --n_threads 2
"""

from pathlib import Path


def cpu_has(flag: str) -> bool:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return flag in line.split(":", 1)[1].split()
    return False


def main() -> None:
    import llama_cpp
    from llama_cpp.server.__main__ import main as server_main

    if cpu_has("amx_tile"):
        default_params = llama_cpp.llama_cpp.llama_model_default_params

        def model_params():
            params = default_params()
            params.use_extra_bufts = False
            return params

        llama_cpp.llama_cpp.llama_model_default_params = model_params
    server_main()


if __name__ == "__main__":
    main()

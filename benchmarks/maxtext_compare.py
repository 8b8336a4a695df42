"""flaxlm beside MaxText, compiled ahead of time for the same TPU slice: per-chip memory and
FLOPs per train step of the same model shape, batch and sequence (not part of `make test`).

    python benchmarks/maxtext_compare.py --shape llama-1b --topology v5e-8
    python benchmarks/maxtext_compare.py --shape llama2-7b --contenders flaxlm maxtext
    python benchmarks/maxtext_compare.py --shape mixtral-8x7b --topology v5p-32 --seq 4096 \
        --contenders maxtext flaxlm-scanned [--expert 8]

Each contender compiles in its own process, with MaxText's venv (`--maxtext-python`, default
/work/mt-venv: `pip install "maxtext[tpu]==0.2.5" "jax[tpu]==0.11.1"` on Python 3.12) so both
use one jax and one libtpu; flaxlm runs from this checkout's src/ there, with its few missing
dependencies in `--extra-path` (hydra-core 1.3.2, omegaconf 2.3.0, antlr4 4.9.3, scikit-learn,
narwhals, threadpoolctl: `pip install --no-deps --target DIR ...`). The settings are MaxText's
defaults, which flaxlm is given too: float32 weights and AdamW state, bfloat16 compute, full
remat, AdamW, fsdp over all chips, `--batch` rows per chip of `--seq` tokens, no dropout. The
MoE shapes (MaxText's presets) are dropless through megablox on both (MaxText's defaults
`sparse_matmul=true megablox=true capacity_factor=-1`; flaxlm's `model.moe.dispatch=auto` on a
TPU), their experts split over `--expert` chips on both (default 1: fsdp only).

Contenders:
- `flaxlm`: the train step `flaxlm-plan` compiles (`flaxlm.aot.abstract_run`), its blocks
  unrolled: `cost_analysis` counts every layer;
- `flaxlm-chunked-loss`: the same with `trainer.loss_chunk_size=512`: memory as trained with
  it; its FLOPs count one chunk of the LM head (a loop's body), so compare `flaxlm`'s;
- `flaxlm-splash`: the chunked loss and the splash attention kernel (what `model.attention=auto`
  takes on a TPU): memory as flaxlm trains on a TPU, to set beside `maxtext` as shipped; its
  FLOPs count no attention (a Pallas kernel);
- `flaxlm-scanned`: the same with `model.scan_layers=true`, laid out as `maxtext` as shipped
  (its FLOPs count one block, a loop's body);
- `maxtext`: `train_compile` as shipped (layers scanned: its FLOPs count one layer);
- `maxtext-counted`: `scan_layers=false attention=dot_product`, the configuration whose FLOPs
  `cost_analysis` counts in full (a scanned loop's body counts once and Pallas kernels count
  nothing).
Both run with XLA's windowed einsums off (`--xla_tpu_enable_windowed_einsum_for_all_gather=false`
and `..._reduce_scatter=false` in LIBTPU_INIT_ARGS), whose loops would hide FLOPs too; the
number of `while` loops left in each compiled program is reported.

Per contender: per-chip memory (`memory_analysis`: arguments + outputs − aliased +
temporaries), FLOPs and bytes accessed per chip (`cost_analysis`), a roofline **estimate**
(max of FLOPs ÷ peak and bytes ÷ HBM bandwidth, from the flaxlm hardware preset's published
figures), compile time, and the largest buffers live at the peak (XLA's buffer-assignment
dump) for finding what costs more. Results are appended to `--out` (JSON) and the table is
written into docs/planning.md.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# MaxText's compile_topology names and flaxlm's presets of the same slices (a preset and the
# topology it is given, for the slices of several hosts no preset names).
TOPOLOGIES = {"v5e-8": ("tpu-v5e-8", "v5litepod-8"), "v5p-8": ("tpu-v5p-8", "v5p-8"),
              "v4-8": ("tpu-v4-8", "v4-8"), "v6e-8": ("tpu-v6e-8", "v6e-8"),
              "v5p-32": ("tpu-v5p-128", "v5p-32", "hardware.topology.name=v5:2x2x4"),
              "v5p-64": ("tpu-v5p-128", "v5p-64", "hardware.topology.name=v5:2x4x4"),
              "v5p-128": ("tpu-v5p-128", "v5p-128")}
# flaxlm's model preset and the MaxText settings of the same shape.
SHAPES = {
    "llama-tiny": ("llama-tiny", [  # a smoke test of this script: seconds, not minutes
        "base_emb_dim=256", "base_num_query_heads=8", "base_num_kv_heads=4", "base_mlp_dim=768",
        "base_num_decoder_layers=6", "head_dim=32", "vocab_size=8192",
        'mlp_activations=["silu","linear"]', "logits_via_embedding=true",
        "decoder_block=llama2", "normalization_layer_epsilon=1.0e-5"]),
    "llama-1b": ("llama-1b", [  # Llama-3.2-1B's shape; MaxText has no preset of it
        "base_emb_dim=2048", "base_num_query_heads=32", "base_num_kv_heads=8",
        "base_mlp_dim=8192", "base_num_decoder_layers=16", "head_dim=64", "vocab_size=128256",
        'mlp_activations=["silu","linear"]', "logits_via_embedding=true",
        "decoder_block=llama2", "normalization_layer_epsilon=1.0e-5",
        "rope_max_timescale=500000"]),
    "llama2-7b": ("llama2-7b", ["model_name=llama2-7b"]),
    # Mixtures of experts: MaxText's presets of the same shapes (checked against flaxlm's in
    # docs/planning.md); both dropless, MaxText's experts through megablox
    # (sparse_matmul=true megablox=true, its defaults), flaxlm's too (model.moe.dispatch=auto
    # on a TPU).
    "mixtral-8x7b": ("mixtral-8x7b", ["model_name=mixtral-8x7b"]),
    "qwen3-30b-a3b": ("qwen3-30b-a3b", ["model_name=qwen3-30b-a3b"]),
}
NO_WINDOWED_EINSUM = ("--xla_tpu_enable_windowed_einsum_for_all_gather=false "
                      "--xla_tpu_enable_windowed_einsum_for_reduce_scatter=false")
COUNTED = ["scan_layers=false", "attention=dot_product"]
# flaxlm's contenders, (trainer.loss_chunk_size, model.attention, model.scan_layers): the
# next-token loss over the whole logits or in chunks of 512 positions, whose loop
# `cost_analysis` counts once; XLA's attention, whose FLOPs it counts (as maxtext-counted's
# dot_product), or the splash kernel; the blocks unrolled or scanned.
FLAXLM = {"flaxlm": (None, "xla", False), "flaxlm-chunked-loss": (512, "xla", False),
          "flaxlm-splash": (512, "splash", False), "flaxlm-scanned": (512, "splash", True)}
GIB = 2**30


def env_for(name: str, topology: str, dump_dir: str, extra_path: str) -> dict:
    """The same compiler settings for both; flaxlm's checkout and its extra dependencies on
    flaxlm's path only (they would shadow MaxText's omegaconf). Several compiles may run at
    once: libtpu's lock file would refuse all but the first (flaxlm sets this itself)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TPU_WORKER_HOSTNAMES": "localhost",
           "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
           "TPU_ACCELERATOR_TYPE": TOPOLOGIES[topology][1],
           "LIBTPU_INIT_ARGS": NO_WINDOWED_EINSUM,
           "XLA_FLAGS": f"--xla_dump_to={dump_dir}"}
    env.pop("PYTHONPATH", None)
    if name in FLAXLM:
        env["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO, "src"), extra_path])
    return env


def contender_command(name: str, python: str, shape: str, topology: str, batch: int,
                      seq: int, out: str, expert: int = 1) -> list[str]:
    if name in FLAXLM:
        return [python, os.path.abspath(__file__), "--worker", "flaxlm", "--shape", shape,
                "--topology", topology, "--batch", str(batch), "--seq", str(seq),
                "--expert", str(expert), "--worker-out", out, "--flaxlm-contender", name]
    args = [f"compile_topology={topology}", "compile_topology_num_slices=1",
            f"per_device_batch_size={batch}", f"max_target_length={seq}", 'jax_cache_dir=""',
            "log_config=false", "enable_dropout=false", *SHAPES[shape][1]]
    if expert > 1:  # the experts over `expert` chips, fsdp (-1, its default) over the rest
        args.append(f"ici_expert_parallelism={expert}")
    if name == "maxtext-counted":
        args += COUNTED
    return [python, os.path.abspath(__file__), "--worker", "maxtext", "--worker-out", out,
            "--", *args]


def flaxlm_overrides(shape: str, topology: str, batch: int, seq: int,
                     contender: str = "flaxlm", expert: int = 1) -> list[str]:
    loss_chunk_size, attention, scan_layers = FLAXLM[contender]
    chunks = [f"trainer.loss_chunk_size={loss_chunk_size}"] if loss_chunk_size else []
    experts = [f"hardware.mesh.expert={expert}"] if expert > 1 else []
    return [f"model={SHAPES[shape][0]}", f"hardware={TOPOLOGIES[topology][0]}",
            *TOPOLOGIES[topology][2:], *experts, f"task.max_seq_length={seq}",
            f"hardware.per_device_batch_size={batch}",
            "hardware.mesh.data=1", "hardware.mesh.fsdp=-1", "model.remat=full",
            "optimizer=adamw", "model.attention_dropout=0.0", *chunks,
            f"model.attention={attention}", f"model.scan_layers={str(scan_layers).lower()}"]


def describe(compiled, started: float) -> dict:
    """The figures of one compiled program (the same in both workers)."""
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    text = compiled.as_text()
    return {
        "compile_s": time.perf_counter() - started,
        "argument_bytes": memory.argument_size_in_bytes,
        "output_bytes": memory.output_size_in_bytes,
        "alias_bytes": memory.alias_size_in_bytes,
        "temp_bytes": memory.temp_size_in_bytes,
        "total_bytes": memory.argument_size_in_bytes + memory.output_size_in_bytes
        - memory.alias_size_in_bytes + memory.temp_size_in_bytes,
        "flops": float(cost.get("flops", 0.0)),
        "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        **collectives(text),
    }


def collectives(text: str) -> dict:
    """Loops and collectives in a compiled TPU program's text. A reduce-scatter is an
    all-reduce inside a fused `all-reduce-scatter` computation there, called once per use."""
    def count(op: str) -> int:
        return len(re.findall(rf"^\s*(?:ROOT )?%\S+ = .* {op}\(", text, re.MULTILINE))

    scatters = len(re.findall(r"calls=%all-reduce-scatter", text))
    scatter_bodies = len(re.findall(r"^%all-reduce-scatter\S* \(", text, re.MULTILINE))
    return {"while_loops": count("while"), "all_gathers": count("all-gather"),
            "reduce_scatters": scatters, "all_reduces": count("all-reduce") - scatter_bodies}


def dumped_collectives(dump_dir: str) -> dict:
    """`collectives` of the train step XLA dumped into `dump_dir` (empty if none)."""
    programs = glob.glob(os.path.join(dump_dir, "*after_optimizations.txt"))
    if not programs:
        return {}
    with open(max(programs, key=os.path.getsize), encoding="utf-8", errors="replace") as f:
        return collectives(f.read())


def flaxlm_worker(args) -> dict:
    from flaxlm import aot
    from flaxlm.cli.plan import compose

    cfg = compose(flaxlm_overrides(args.shape, args.topology, args.batch, args.seq,
                                   args.flaxlm_contender, args.expert))
    run = aot.abstract_run(cfg)
    started = time.perf_counter()
    compiled = run.steps.train.lower(*run.train_args).compile()
    figures = describe(compiled, started)
    state = run.state
    figures["param_bytes"] = aot.per_device_bytes(state.params)
    figures["opt_state_bytes"] = aot.per_device_bytes((state.step, state.opt_state))
    return figures


def maxtext_worker(args) -> dict:
    """MaxText's own train_compile.main, with its compiled program kept for the figures."""
    from absl import app  # noqa: F401 — MaxText's flags parser expects absl
    from maxtext.trainers.pre_train import train_compile

    captured = {}
    compile_program = train_compile.jit_and_compile

    def keep(*call_args, **call_kwargs):
        started = time.perf_counter()
        compiled = compile_program(*call_args, **call_kwargs)
        captured.update(describe(compiled, started))
        return compiled

    train_compile.jit_and_compile = keep
    train_compile.main(["train_compile", *args.maxtext_args])
    return captured


def peak_buffers(dump_dir: str, limit: int = 15) -> list[str]:
    """The train step's largest allocations (size; the values sharing it), from XLA's
    memory-usage report in `dump_dir`: what the temporaries are made of."""
    reports = glob.glob(os.path.join(dump_dir, "*memory-usage-report.txt"))
    if not reports:
        return []
    with open(max(reports, key=os.path.getsize), encoding="utf-8", errors="replace") as f:
        rows = [line.strip() for line in f if re.match(r"\s+[\d.]+[KMG]i?B\(", line)]
    return [" ".join(f.strip() for f in row.split(";")[1::3])[:240] for row in rows[:limit]]


def dump_name(contender: str, shape: str, topology: str, expert: int) -> str:
    """The folder of one contender's XLA dump under --dump-dir."""
    return f"{contender}-{shape}-{topology}" + (f"-expert{expert}" if expert > 1 else "")


def run_contender(name: str, args) -> dict:
    python = args.flaxlm_python if name in FLAXLM else args.maxtext_python
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "figures.json")
        dump = os.path.join(args.dump_dir, dump_name(name, args.shape, args.topology,
                                                     args.expert))
        command = contender_command(name, python, args.shape, args.topology, args.batch,
                                    args.seq, out, args.expert)
        started = time.perf_counter()
        proc = subprocess.run(command, env=env_for(name, args.topology, dump, args.extra_path),
                              cwd=REPO, capture_output=True, text=True, timeout=args.timeout_s)
        result = {"contender": name, "shape": args.shape, "topology": args.topology,
                  "batch": args.batch, "seq": args.seq, "expert": args.expert,
                  "wall_s": time.perf_counter() - started,
                  "command": command[command.index("--") + 1:] if "--" in command
                  else flaxlm_overrides(args.shape, args.topology, args.batch, args.seq, name,
                                        args.expert)}
        if proc.returncode != 0 or not os.path.exists(out):
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
            result["error"] = "\n".join(tail)
            return result
        with open(out, encoding="utf-8") as f:
            result.update(json.load(f))
        result.update(dumped_collectives(dump))
        result["peak_buffers"] = peak_buffers(dump)
    return result


def roofline(result: dict, topology: str) -> dict:
    from omegaconf import OmegaConf

    def load(name: str):  # a preset and the one it extends (tpu-v5p-128's tpu-v5p-8)
        preset = OmegaConf.load(os.path.join(REPO, "conf", "hardware", f"{name}.yaml"))
        if "peak_tflops_per_device" in preset:
            return preset
        return OmegaConf.merge(load(preset.defaults[0]), preset)

    preset = load(TOPOLOGIES[topology][0])
    compute = result["flops"] / (preset.peak_tflops_per_device * 1e12)
    memory = result["bytes_accessed"] / (preset.hbm_gbps_per_device * 1e9)
    return {"compute_s": compute, "memory_s": memory, "roofline_s": max(compute, memory),
            "hbm_gib": float(preset.hbm_gib_per_device)}


def table(results: list[dict]) -> str:
    lines = ["| shape | slice | contender | per-chip memory (GiB) | temporaries (GiB) | "
             "TFLOP per chip | loops left | all-gather / reduce-scatter / all-reduce | "
             "roofline step (estimate) | compile |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    # Grouped by shape and slice, MaxText's rows first; contenders no longer in the script
    # (an earlier flaxlm's, kept for the record) last.
    order = ["maxtext", "maxtext-counted", *FLAXLM]

    def place(r: dict) -> tuple:
        known = r["contender"] in order
        return (list(SHAPES).index(r["shape"]), r["topology"], r.get("expert", 1), not known,
                order.index(r["contender"]) if known else 0)

    def row(r: dict) -> str:  # the shape and slice, with what differs from the defaults
        seq = f", {r['seq']} tokens" if r["seq"] != 2048 else ""
        expert = f", expert={r['expert']}" if r.get("expert", 1) > 1 else ""
        return f"| {r['shape']}{seq} | {r['topology']}{expert} | {r['contender']} | "

    for r in sorted(results, key=place):
        if "error" in r:
            lines.append(f"{row(r)}error | | | | | | |")
            continue
        lines.append(
            f"{row(r)}"
            f"{r['total_bytes'] / GIB:.2f} | {r['temp_bytes'] / GIB:.2f} | "
            f"{r['flops'] / 1e12:.2f} | {r['while_loops']} | "
            f"{r.get('all_gathers', '?')} / {r.get('reduce_scatters', '?')} / "
            f"{r.get('all_reduces', '?')} | "
            f"{r['roofline_s'] * 1e3:,.0f} ms | {r['compile_s']:.0f} s |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parse = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parse.add_argument("--shape", choices=SHAPES, default="llama-1b")
    parse.add_argument("--topology", choices=TOPOLOGIES, default="v5e-8")
    parse.add_argument("--batch", type=int, default=1, help="rows per chip (default 1)")
    parse.add_argument("--seq", type=int, default=2048, help="tokens per row (default 2048)")
    parse.add_argument("--expert", type=int, default=1,
                       help="chips the experts are split over (an MoE shape): flaxlm's "
                            "hardware.mesh.expert, MaxText's ici_expert_parallelism; fsdp over "
                            "the rest (default 1: fsdp only)")
    parse.add_argument("--contenders", nargs="+", default=["flaxlm", "flaxlm-chunked-loss",
                                                           "maxtext", "maxtext-counted"],
                       choices=[*FLAXLM, "maxtext", "maxtext-counted"])
    parse.add_argument("--maxtext-python", default="/work/mt-venv/bin/python")
    parse.add_argument("--flaxlm-python", default=None,
                       help="the python flaxlm compiles with (default: --maxtext-python, "
                            "for the same jax and libtpu)")
    parse.add_argument("--extra-path", default="/tmp/maxtext-compare/hydra",
                       help="flaxlm's dependencies MaxText's venv lacks (see the docstring)")
    parse.add_argument("--timeout-s", type=float, default=3600)
    parse.add_argument("--dump-dir", default=os.path.join(tempfile.gettempdir(),
                                                          "maxtext-compare-dumps"),
                       help="XLA's dumps of each compiled step (HLO, buffer assignment)")
    parse.add_argument("--out", default=os.path.join(REPO, "benchmarks",
                                                     "maxtext_compare.json"))
    parse.add_argument("--table", action="store_true", help="print --out as a table; compile "
                       "nothing")
    parse.add_argument("--docs", default=os.path.join(REPO, "docs", "planning.md"),
                       help="the page whose maxtext-compare markers get the table")
    parse.add_argument("--worker", choices=["flaxlm", "maxtext"], help=argparse.SUPPRESS)
    parse.add_argument("--worker-out", help=argparse.SUPPRESS)
    parse.add_argument("--flaxlm-contender", choices=list(FLAXLM), default="flaxlm",
                       help=argparse.SUPPRESS)
    parse.add_argument("maxtext_args", nargs="*", help=argparse.SUPPRESS)
    args = parse.parse_args(argv)
    if args.worker:
        figures = (flaxlm_worker if args.worker == "flaxlm" else maxtext_worker)(args)
        with open(args.worker_out, "w", encoding="utf-8") as f:
            json.dump(figures, f)
        return
    results = []
    if os.path.exists(args.out):
        with open(args.out, encoding="utf-8") as f:
            results = json.load(f)
    for result in results:  # figures read from the dumps, should the parsing improve
        result.update(dumped_collectives(os.path.join(args.dump_dir, dump_name(
            result["contender"], result["shape"], result["topology"], result.get("expert", 1)))))
    if not args.table:
        args.flaxlm_python = args.flaxlm_python or args.maxtext_python
        for name in args.contenders:
            print(f"compiling {name} ({args.shape}, {args.topology}) ...", flush=True)
            result = run_contender(name, args)
            if "error" not in result:
                result.update(roofline(result, args.topology))
            print(json.dumps({k: v for k, v in result.items() if k != "peak_buffers"}),
                  flush=True)
            for line in result.get("peak_buffers", []):
                print("   ", line, flush=True)
            results = [r for r in results if (r["contender"], r["shape"], r["topology"],
                                              r["batch"], r["seq"], r.get("expert", 1)) != (
                name, args.shape, args.topology, args.batch, args.seq, args.expert)] + [result]
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(results, f, indent=1)
    print(table(results))
    write_table(args.docs, table(results))


def write_table(path: str, text: str) -> None:
    """`text` between the page's `<!-- maxtext-compare:start/end -->` markers."""
    start, end = "<!-- maxtext-compare:start -->", "<!-- maxtext-compare:end -->"
    with open(path, encoding="utf-8") as f:
        page = f.read()
    if start not in page or end not in page:
        return
    head, rest = page.split(start, 1)
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"{head}{start}\n{text}\n{end}{rest.split(end, 1)[1]}")


if __name__ == "__main__":
    main()

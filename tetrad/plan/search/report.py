"""Output of the planner: the ranked table, JSON, a PNG of the top configurations, and a TOML
that ``tetrad train --config`` accepts.

Plain Python; matplotlib is imported only by :func:`plot`, tomli_w only by the TOML writer (so
`tetrad train` runs where it is not installed, as on GPU images).
"""

from __future__ import annotations

import json
import os

from tetrad.plan.errors import PlanError
from tetrad.plan.memory.breakdown import FIT_FRACTION, MemoryBreakdown
from tetrad.plan.search.rows import Row, SearchResult
from tetrad.spec.conflicts import MOE_SIZES
from tetrad.spec.grid import COMM_AXES, format_grid
from tetrad.spec.model import ModelSpec
from tetrad.spec.overlap import OVERLAPS
from tetrad.spec.units import GiB

AXES_CLASSIC = ("tp", "cp", "pp", "dp")


def _fmt_s(v: float) -> str:
    if v == 0:
        return "-"
    if v >= 100:
        return f"{v:.0f}"
    if v >= 1:
        return f"{v:.2f}"
    if v >= 0.001:
        return f"{v:.3f}"
    return "<.001"


def _tokens(v: float) -> str:
    for unit, div in (("M", 1e6), ("k", 1e3)):
        if v >= div:
            return f"{v / div:.2f}{unit}"
    return f"{v:.0f}"


def _table(header: list[str], rows: list[list[str]], left: bool = False) -> list[str]:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)
    ]
    fmt = "  ".join(
        "{:" + ("<" if i == 0 and left else ">") + str(w) + "}" for i, w in enumerate(widths)
    )
    out = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*r) for r in rows]
    return out


def _mem_cell(mem: MemoryBreakdown) -> str:
    return f"{mem.total / GiB:.1f} ({100 * mem.fraction:.0f}%)"


def rows_table(rows: list[Row]) -> list[str]:
    """Lines of the ranked table of 4D or classic rows (seconds per optimizer step)."""
    if not rows:
        return []
    classic = rows[0].space == "classic"
    piped = not classic and any(r.pipe > 1 for r in rows)
    axes = AXES_CLASSIC if classic else COMM_AXES + (("pipe",) if piped else ())
    if any(r.expert for r in rows):  # a mixture-of-experts model: its all-to-alls
        axes += ("ep",) if classic else ("expert",)
    head = (
        [
            "#",
            "TP,CP,PP,DP" if classic else ("[P v sched] " if piped else "") + "D,C,Z,Y,X (turn)",
            "mb",
            "acc",
            "ckpt",
            "step s",
            "tok/s",
            "MFU",
            "compute",
        ]
        + [f"exp {a}" for a in axes]
        + (["bubble"] if classic or piped else [])
        + ["mem GiB (%)"]
    )
    body = []
    for i, r in enumerate(rows, 1):
        cells = [
            str(i),
            _pipe_cell(r)
            + ",".join(str(v) for v in r.grid)
            + (" yx" if r.orientation == "yx" else "")
            + (" so" if r.shard_optimizer else "")
            + (" sp" if r.sequence_parallel else "")
            + (f" ep={r.expert}" if r.expert else "")
            + r.classic_suffix(),
            str(r.micro_batch),
            str(r.grad_accum),
            r.activation_checkpointing,
            f"{r.step_s:.3g}",
            _tokens(r.tokens_per_s),
            f"{100 * r.mfu:.1f}%",
            _fmt_s(r.compute_s),
        ]
        cells += [_fmt_s(r.exposed_s.get(a, 0.0)) for a in axes]
        if classic or piped:
            cells.append(_fmt_s(r.other_s.get("pipeline_bubble", 0.0)))
        cells.append(_mem_cell(r.memory))
        body.append(cells)
    return _table(head, body)


def _pipe_cell(r: Row) -> str:
    """``P4 v2 interleaved-1f1b | `` for a 4D row with a pipeline (classic rows: their PP is in
    the grid; with ``v > 1`` the interleaved schedule is named)."""
    if r.space == "classic" or r.pipe == 1:
        return ""
    v = f" v{r.virtual_stages}" if r.virtual_stages > 1 else ""
    return f"P{r.pipe}{v} {r.schedule} | "


def memory_table(rows: list[Row]) -> list[str]:
    """Lines of the memory components (GiB) of the ranked rows."""
    if not rows:
        return []
    comps: list[str] = []
    for r in rows:
        for k, v in r.memory.components.items():
            if v and k not in comps:
                comps.append(k)
    short = {
        "parameters": "params",
        "gradients": "grads",
        "optimizer_states": "optim",
        "activations": "activ",
        "logits_and_loss": "logits",
        "embedding_input": "emb_in",
        "recompute_activations": "recomp",
        "gathered_weights": "gathered",
        "reduce_scatter_buffers": "rs_buf",
        "step_buffers": "step_buf",
    }
    head = ["#"] + [short.get(c, c) for c in comps] + ["total", "peak at"]
    body = []
    for i, r in enumerate(rows, 1):
        body.append(
            [str(i)]
            + [f"{r.memory.components.get(c, 0.0) / GiB:.2f}" for c in comps]
            + [f"{r.memory.total / GiB:.2f}", r.memory.peak_phase or "-"]
        )
    return _table(head, body)


def _pipeline_searched(f4: dict, rows: list) -> str:
    """What the header says of the pipeline search, and why no pipeline row is shown when none
    is."""
    timed = f4.get("pipe_evaluated", 0)
    why = ""
    if not any(r.pipe > 1 for r in rows):
        why = " (no pipeline row below: none ranked among these" + (
            ")" if timed else ", each one's lower bound being slower, so none was timed)"
        )
    return (
        f"; pipeline (G_pipe x virtual stages x schedule on top): "
        f"{f4.get('pipe_candidates', 0)} bounded, {timed} timed{why}"
    )


def format_result(result: SearchResult) -> str:
    """The text report of ``tetrad plan``."""
    inp = result.inputs
    st = result.stats
    f4 = st.get("four_d", {})
    lines = [
        f"model   {inp['model_summary']}",
        f"machine {inp['machine_summary']}",
        f"job     {inp['gpus']} GPUs, global batch {inp['global_batch']} x {inp['seq_len']} "
        f"tokens; overlaps: {', '.join(inp['overlaps']) or 'none'}; comm model: "
        f"{inp['comm_model']}"
        + (
            f"; fp8 {inp['fp8']} (MFU against the bf16 peak; the classic space is not searched)"
            if inp.get("fp8", "off") != "off"
            else ""
        )
        + (
            f"; residual stream {inp['residual_dtype']} (the 4D space)"
            if inp.get("residual_dtype", "auto") != "auto"
            else ""
        )
        + (
            "; sequence parallelism with regather (the 4D space)"
            if inp.get("sequence_parallel_regather")
            else ""
        ),
        "",
    ]
    if "moe_imbalance" in inp:
        lines.append(
            f"4D grids with the expert axis (ep = G_expert, folded over a stage's ranks; "
            f"1f1b pipelines; busiest rank's routed rows {inp['moe_imbalance']:g} x the "
            f"mean): {f4.get('grids', 0)} grids, {f4.get('candidates', 0)} configurations, "
            f"{f4.get('fitting', 0)} fit under {100 * FIT_FRACTION:.0f}% of "
            f"{inp['gpu_memory_gib']:.1f} GiB, {f4.get('evaluated', 0)} timed"
        )
    else:
        lines.append(
            "tetrad/AxoNN grids (G_data x G_context x G_z x G_y x G_x, the D,C,Z,Y,X column): "
            f"{f4.get('grids', 0)} grids, "
            f"{f4.get('valid_grids', 0)} shard the model; on the {f4.get('memory_groups', 0)} "
            f"(grid, orientation) whose memory the search needed, {f4.get('fitting', 0)} "
            f"configurations fit under {100 * FIT_FRACTION:.0f}% of "
            f"{inp['gpu_memory_gib']:.1f} GiB, {f4.get('evaluated', 0)} timed"
            + (_pipeline_searched(f4, result.rows) if "pipe_candidates" in f4 else "")
        )
    lines += rows_table(result.rows)
    lines += ["", "memory of these (GiB):"] + memory_table(result.rows)
    if "classic" in st and st["classic"]:
        cs = st["classic"]
        lines += [
            "",
            f"classic Megatron-style (TP x CP x PP x DP; Fujii et al. memory): "
            f"{cs.get('configs', 0)} configurations, {cs.get('fitting', 0)} fit",
        ]
        if result.classic:
            lines += rows_table(result.classic)
        else:
            lines += ["  none fits (TP*CP is kept within a node and PP must divide the layers)"]
    lines += [
        "",
        "times are seconds per optimizer step per rank; exp = exposed (not hidden) "
        "communication; acc = micro-batches per step; mb = samples per micro-batch of one "
        "(data, z) cell (classic: per DP rank); yx = the grid's X dimension plays the Y role "
        "of the layer pairs (their first layer splits its output over X); so = AdamW states "
        "sharded over data x context (--shard-optimizer: gradients reduce-scattered, "
        "parameters all-gathered over them); "
        + (
            "sp = sequence parallelism, regather (--sequence-parallel-regather: each layer "
            "pair's first Linear keeps its input split along the sequence over Y and "
            "all-gathers it again in backward); "
            if inp.get("sequence_parallel_regather")
            else ""
        )
        + (
            "ep = the expert axis (exp expert: the all-to-alls and the expert gradients' "
            "sums; classic: EP with ETP = 1, folded over TP x CP x DP); "
            if "moe_imbalance" in inp
            else ""
        )
        + "search took "
        f"{st.get('seconds', 0.0):.2f} s",
    ]
    return "\n".join(lines)


def to_json(result: SearchResult) -> str:
    """The same as JSON (plain types, seconds and bytes)."""
    return json.dumps(result.to_dict(), indent=2)


def plot(result: SearchResult, path: str, top: int = 10) -> None:
    """A PNG: stacked time breakdown (compute, recompute, exposed communication per axis) and
    stacked memory components of the top configurations, with the 80% line.

    Raises:
        PlanError: matplotlib is not installed, or the file cannot be written.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlanError("--plot needs matplotlib: pip install matplotlib") from None
    rows = result.rows[:top] + result.classic[: max(0, min(3, top))]
    labels = [
        ("4D " if r.space == "4d" else "MG ")
        + ",".join(str(v) for v in r.grid)
        + f" mb{r.micro_batch}"
        + ("" if r.activation_checkpointing == "none" else f" {r.activation_checkpointing}")
        for r in rows
    ]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(14, 0.45 * len(rows) + 3.5))
    ypos = list(range(len(rows)))[::-1]
    parts = [
        ("compute", lambda r: r.compute_s - r.recompute_s),
        ("recompute", lambda r: r.recompute_s),
    ]
    for a in (*COMM_AXES, *AXES_CLASSIC):
        parts.append((f"exposed {a}", lambda r, a=a: r.exposed_s.get(a, 0.0)))
    parts.append(("exposed expert", lambda r: r.exposed_s.get("expert", r.exposed_s.get("ep", 0))))
    parts.append(("pipeline bubble", lambda r: r.other_s.get("pipeline_bubble", 0.0)))
    left = [0.0] * len(rows)
    for name, fn in parts:
        vals = [fn(r) for r in rows]
        if not any(vals):
            continue
        ax_t.barh(ypos, vals, left=left, label=name)
        left = [x + v for x, v in zip(left, vals, strict=True)]
    ax_t.set_yticks(ypos, labels, fontsize=8)
    ax_t.set_xlabel("seconds per optimizer step")
    ax_t.set_title(
        f"{result.inputs['model']} on {result.inputs['gpus']} x {result.inputs['machine']}"
    )
    ax_t.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=4)
    comps: list[str] = []
    for r in rows:
        comps += [k for k, v in r.memory.components.items() if v and k not in comps]
    left = [0.0] * len(rows)
    for comp in comps:
        vals = [r.memory.components.get(comp, 0.0) / GiB for r in rows]
        ax_m.barh(ypos, vals, left=left, label=comp)
        left = [x + v for x, v in zip(left, vals, strict=True)]
    gib = result.inputs["gpu_memory_gib"]
    ax_m.axvline(FIT_FRACTION * gib, color="red", linestyle="--", label="80% of GPU memory")
    ax_m.axvline(gib, color="black", linewidth=1)
    ax_m.set_yticks(ypos, [""] * len(rows))
    ax_m.set_xlabel("GiB per GPU")
    ax_m.set_title("memory estimate")
    ax_m.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise PlanError(
            f"cannot write the plot {path!r} ({e.strerror}): choose another --plot path"
        ) from None
    finally:
        plt.close(fig)


def train_config_text(row: Row, model: ModelSpec, result: SearchResult) -> str:
    """A TOML file of ``tetrad train`` settings for a 4D row (``tetrad.train.config.load_config``
    reads it: ``[model]`` sizes in the runtime's names, ``[parallelism]``, ``[training]``)."""
    if row.space != "4d":
        raise PlanError("--emit-config writes a 4D configuration; the best row is classic")
    inp = result.inputs
    header = [
        f"# Written by `tetrad plan`: {inp['model']} on {inp['gpus']} x {inp['machine']}.",
        f"# Predicted {row.step_s:.3f} s per step, {row.tokens_per_s:.0f} tokens/s, "
        f"MFU {100 * row.mfu:.1f}%, memory {row.memory.total / GiB:.1f} GiB "
        f"({100 * row.memory.fraction:.0f}% of {inp['gpu_memory_gib']:.1f} GiB).",
    ]
    header.append(
        f"# vocab_size {model.vocab_size} is the vocabulary planned for: a tokenizer with more "
        "tokens needs it raised (or removed, to follow the tokenizer)."
    )
    if model.family != "llama":
        header.append(
            f"# NOTE: {model.name} is a {model.family} model; tetrad trains the Llama "
            "architecture, so the sizes below build a Llama (SwiGLU with ffn_dim, "
            "RMSNorm, RoPE) of the same widths."
        )
    sizes = {
        "dim": model.dim,
        "n_layers": model.n_layers,
        "n_heads": model.n_heads,
        "n_kv_heads": model.n_kv_heads,
        "ffn_dim": model.ffn_dim,
        "vocab_size": model.vocab_size,
        "rope_theta": model.rope_theta,
    }
    sizes |= _other_sizes(model)
    settings = {  # the sections of tetrad.train.config
        "model": sizes,
        "parallelism": {
            # DATA,CONTEXT,Z,Y,X, or PIPE,DATA,CONTEXT,Z,Y,X with a pipeline
            "grid": format_grid(row.pipe, row.grid)
            if row.pipe > 1
            else ",".join(map(str, row.grid)),
            **_pipeline_keys(row),
            "orientation": row.orientation,
            "overlap": _overlap_value(inp["overlaps"]),
            "activation_checkpointing": row.activation_checkpointing,
            **({"shard_optimizer": True} if row.shard_optimizer else {}),
            **({"sequence_parallel": True} if row.sequence_parallel else {}),
            **(
                {"sequence_parallel_regather": True}
                if row.sequence_parallel and inp.get("sequence_parallel_regather")
                else {}
            ),
            **({"expert_parallel": row.expert} if row.expert > 1 else {}),
        },
        "training": {
            "micro_batch": row.micro_batch,
            "global_batch": inp["global_batch"],
            "seq_len": inp["seq_len"],
            "device": "cuda",
        },
    }
    precision = {}  # [precision] of tetrad.train.config, where not the default
    if inp.get("param_dtype", "fp32") != "fp32":
        precision["params"] = inp["param_dtype"]
    if inp.get("residual_dtype", "auto") != "auto":
        precision["residual"] = inp["residual_dtype"]
    if inp.get("fp8", "off") != "off":
        precision["fp8"] = inp["fp8"]
    if precision:
        settings["precision"] = precision
    import tomli_w

    return "\n".join(header) + "\n" + tomli_w.dumps(settings)


TRAINED_SIZES = (
    "norm_eps",
    "rope_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_positions",
    "attn_head_dim",
    "qk_norm",
    "n_experts",
    *MOE_SIZES,
)
"""The model sizes :func:`train_config_text` writes beside the widths where they differ from
:class:`~tetrad.spec.model.ModelSpec`'s defaults: a Llama's norm and RoPE scaling, Qwen3's q/k
norms and a mixture of experts' whole description (without them the file would build a dense
model of the same widths)."""


def _other_sizes(model: ModelSpec) -> dict:
    """The :data:`TRAINED_SIZES` of ``model`` that differ from the defaults."""
    defaults = ModelSpec()
    return {
        k: getattr(model, k) for k in TRAINED_SIZES if getattr(model, k) != getattr(defaults, k)
    }


def _pipeline_keys(row: Row) -> dict:
    """``pipeline_schedule`` (:data:`tetrad.plan.pipe.schedule.SCHEDULES`) and
    ``virtual_stages`` of a row with a pipeline (none without one, so those files load in a
    runtime without the pipeline axis)."""
    if row.pipe == 1:
        return {}
    return {"pipeline_schedule": row.schedule, "virtual_stages": row.virtual_stages}


def _overlap_value(names: list[str]) -> str:
    """The runtime's ``overlap`` setting for a set of overlap names."""
    if not names:
        return "none"
    if set(names) == set(OVERLAPS):
        return "all"
    return ",".join(sorted(names))


def emit_config(row: Row, model: ModelSpec, result: SearchResult, path: str) -> None:
    """Write :func:`train_config_text` to ``path``.

    Raises:
        PlanError: the file cannot be written.
    """
    text = train_config_text(row, model, result)
    try:
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
    except OSError as e:
        raise PlanError(
            f"cannot write {path!r} ({e.strerror}): choose another --emit-config path"
        ) from None


def moe_terms_text(terms: dict[str, float]) -> str:
    """The mixture-of-experts lines of ``tetrad memory`` (:func:`tetrad.plan.memory.moe.
    moe_terms`, bytes, shown in GiB); empty for a dense model."""
    if not terms:
        return ""
    lines = ["", "MoE terms (inside the components above, per rank; with a pipeline one stage's, "]
    lines[-1] += "one micro-batch):"
    lines += [f"  {name}: {v / GiB:.3f} GiB" for name, v in terms.items()]
    return "\n".join(lines)


def memory_text(
    mem: MemoryBreakdown,
    title: str,
    hint: str = "raise the parallelism, lower the micro-batch or checkpoint activations",
) -> str:
    """The text of ``tetrad memory``: components in GiB and % of GPU memory, total, verdict
    (``hint``: what to change when it does not fit)."""
    gpu = mem.gpu_memory_bytes
    rows = [[k, f"{v / GiB:.2f}", f"{100 * v / gpu:.1f}%"] for k, v in mem.components.items() if v]
    rows.append(["total", f"{mem.total / GiB:.2f}", f"{100 * mem.fraction:.1f}%"])
    lines = [title] + _table(["component", "GiB", "% of GPU"], rows, left=True)
    if mem.peak_phase:
        lines.append(f"peak during: {mem.peak_phase}")
    limit = FIT_FRACTION * gpu / GiB
    if mem.fits:
        lines.append(
            f"fits: {mem.total / GiB:.2f} GiB <= {limit:.2f} GiB (80% of "
            f"{gpu / GiB:.1f} GiB; Fujii et al. 2024: never ran out of memory below "
            "80%)"
        )
    else:
        lines.append(
            f"does NOT fit: {mem.total / GiB:.2f} GiB > {limit:.2f} GiB (80% of "
            f"{gpu / GiB:.1f} GiB): {hint}"
        )
    return "\n".join(lines)

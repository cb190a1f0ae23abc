"""One numeric-format policy decides every dtype of the step (:mod:`tetrad.spec.precision`): the
policies of the CPU and of CUDA say what they say, and the layers follow the policy they run
under. The CUDA policy runs here on the CPU's own bf16 autocast: the same policy, the same
layers, the same casts (only the kernels differ)."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.distributed import run_distributed
from tetrad.dtypes import autocast, policy_of, torch_dtype
from tetrad.grid import Grid
from tetrad.parallel import init_parameters
from tetrad.parallel.model import ParallelLlama
from tetrad.pipeline.stage import StageForward
from tetrad.spec.precision import Precision, PrecisionError, precision
from tetrad.spec.presets import PRESETS

GEMMS = {"mm", "addmm", "bmm", "_grouped_mm", "baddbmm"}
"""aten ops whose outputs are the policy's ``compute`` format."""


class GemmDtypes(TorchDispatchMode):
    """Records the output dtype of every GEMM (aten op of :data:`GEMMS`) while active."""

    def __init__(self):
        super().__init__()
        self.seen: dict[str, set[torch.dtype]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        if name in GEMMS and isinstance(out, torch.Tensor):
            self.seen.setdefault(name, set()).add(out.dtype)
        return out


def test_the_policies():
    cpu, cuda = precision("cpu"), precision("cuda")
    assert dataclasses.asdict(cpu) == {
        "compute": "fp32",
        "params": "fp32",
        "master": "fp32",
        "grads": "fp32",
        "optimizer_states": "fp32",
        "residual": "fp32",
        "stage_boundary": "fp32",
        "statistics": "fp32",
        "grad_reduce": "fp32",
        "fp8": "off",
    }
    assert dataclasses.asdict(cuda) == dataclasses.asdict(cpu) | {
        "compute": "bf16",
        "residual": "bf16",
        "stage_boundary": "bf16",
    }
    assert not cpu.autocast and cuda.autocast
    assert policy_of(torch.device("cuda", 0)) == cuda and policy_of("cpu") == cpu
    assert cuda.bytes("compute") == 2 and cuda.bytes("grads") == 4
    with pytest.raises(PrecisionError, match="fp16"):
        Precision(compute="fp16")
    with pytest.raises(PrecisionError, match="stage_boundary=fp32 with compute=bf16"):
        Precision(compute="bf16")
    # bf16 weights: bf16 GEMMs, residual stream and boundaries on every device; fp32 masters,
    # grads; --residual-dtype fp32 keeps an fp32 stream under bf16 compute
    for device in ("cpu", "cuda"):
        bf16 = precision(device, "bf16", grad_reduce="bf16")
        assert dataclasses.asdict(bf16) == dataclasses.asdict(cpu) | {
            "compute": "bf16",
            "params": "bf16",
            "residual": "bf16",
            "stage_boundary": "bf16",
            "grad_reduce": "bf16",
        }
        assert bf16.masters and bf16.autocast and bf16.bytes("params") == 2
        assert precision(device, "bf16", residual="bf16") == precision(device, "bf16")
        kept = precision(device, "bf16", residual="fp32")
        assert kept == dataclasses.replace(precision(device, "bf16"), residual="fp32")
        assert kept.autocast and kept.bytes("residual") == 4
    assert precision("cuda", residual="fp32").residual == "fp32"
    assert precision("cpu", residual="fp32") == precision("cpu", residual="auto") == cpu
    with pytest.raises(PrecisionError, match="residual dtype bf16 on cpu with fp32 weights"):
        precision("cpu", residual="bf16")
    with pytest.raises(PrecisionError, match="residual dtype 'fp16': use auto, fp32, bf16"):
        precision("cuda", residual="fp16")
    with pytest.raises(PrecisionError, match="residual=bf16 with compute=fp32"):
        Precision(residual="bf16")
    assert not cpu.masters and not cuda.masters
    with pytest.raises(PrecisionError, match="master=bf16: the runtime keeps master in fp32"):
        Precision(compute="bf16", params="bf16", stage_boundary="bf16", master="bf16")
    with pytest.raises(PrecisionError, match="compute=fp32 with params=bf16"):
        Precision(params="bf16")
    with pytest.raises(PrecisionError, match="param dtype 'fp16': use fp32 or bf16"):
        precision("cpu", "fp16")


def _follow(device_policy: str, residual: str, path: str) -> None:
    policy = precision(device_policy, residual=residual)
    grid = Grid.build((1, 1, 1, 1, 1), "cpu")
    cfg = dataclasses.replace(PRESETS["moe-tiny"], vocab_size=256)
    model = ParallelLlama(cfg, grid)
    init_parameters(model, 0, grid)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    residual, normed = [], []
    for block in model.layers.values():
        block.register_forward_hook(lambda m, a, o: residual.append(o.dtype))
        block.ffn_norm.register_forward_hook(lambda m, a, o: normed.append(o.dtype))
    gemms, saved = GemmDtypes(), []  # saved: the dtypes of the saved [b, s, h] tensors
    hidden = (2, 15, cfg.dim)

    def pack(t):
        if t.shape == hidden and not isinstance(t, torch.nn.Parameter):
            saved.append(str(t.dtype))
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with gemms, hooks, autocast(torch.device("cpu"), policy):
        loss = model.loss_sum(tokens[:, :-1], tokens[:, 1:])
        boundary = StageForward(model, sends=True)(tokens[:, :-1])
    loss.backward()
    out = dict(
        gemms={k: sorted(map(str, v)) for k, v in gemms.seen.items()},
        params=sorted({str(p.dtype) for p in model.parameters()}),
        grads=sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None}),
        residual=sorted(map(str, set(residual))),
        normed=sorted(map(str, set(normed))),
        loss=str(loss.dtype),
        boundary=str(boundary.dtype),
        saved=sorted(set(saved)),
    )
    Path(path).write_text(json.dumps(out))


@pytest.mark.parametrize(
    ("device", "residual"), [("cpu", "auto"), ("cuda", "auto"), ("cuda", "fp32")]
)
def test_the_layers_follow_the_policy(device, residual, tmp_path):
    """The GEMMs, the norms' outputs, the residual stream (each block's output), the stage
    boundary and the loss are in the policy's formats; the residual stream's tensors that
    autograd saves (``[b, s, h]``: the norms' inputs and normalised tensors) are in the
    residual format too: with a bf16 stream no fp32 copy of it is kept (``cuda`` with fp32
    weights and the default stream, on the CPU's autocast), with ``--residual-dtype fp32``
    the fp32 stream is."""
    policy = precision(device, residual=residual)
    run_distributed(_follow, 1, device, residual, str(tmp_path / "out.json"))
    out = json.loads((tmp_path / "out.json").read_text())
    name = {f: str(torch_dtype(v)) for f, v in dataclasses.asdict(policy).items() if f != "fp8"}
    assert out["gemms"] and all(v == [name["compute"]] for v in out["gemms"].values()), out
    assert out["normed"] == [name["compute"]]  # a norm's output is the next GEMM's input
    assert out["params"] == [name["params"]] and out["grads"] == [name["grads"]]
    assert out["residual"] == [name["residual"]]
    assert name["residual"] in out["saved"]
    if policy.residual == "bf16":
        assert out["saved"] == ["torch.bfloat16"], out["saved"]
    assert out["boundary"] == name["stage_boundary"]
    assert out["loss"] == name["statistics"]


def test_param_dtype_option(tmp_path):
    """``--param-dtype`` / ``[precision] params`` and ``--grad-reduce-dtype`` choose the run's
    policy (fp32 by default on either device); another value is refused in one line."""
    from tetrad.train.config import load_config
    from tetrad.train.sections import ConfigError

    assert load_config(None, {}).policy == precision("cpu")
    assert load_config(None, {"device": "cuda"}).policy == precision("cuda")
    cfg = load_config(None, {"param_dtype": "bf16", "grad_reduce_dtype": "bf16"})
    assert cfg.policy == precision("cpu", "bf16", "bf16") and cfg.policy.masters
    toml = tmp_path / "run.toml"
    toml.write_text('[precision]\nparams = "bf16"\n')
    assert load_config(str(toml), {}).policy.params == "bf16"
    with pytest.raises(ConfigError, match="param_dtype"):
        load_config(None, {"param_dtype": "fp16"})


def test_residual_dtype_option(tmp_path):
    """``--residual-dtype`` / ``[precision] residual``: ``auto`` (the default) is the compute
    dtype (fp32 on the CPU, bf16 with bf16 weights or on CUDA); ``fp32`` keeps an fp32 stream
    under bf16 compute; bf16 under fp32 compute and an unknown format are refused in one
    line."""
    from tests.test_cli import assert_one_line_error, tetrad_cmd
    from tetrad.train.config import load_config
    from tetrad.train.sections import ConfigError

    assert load_config(None, {}).policy.residual == "fp32"
    assert load_config(None, {"device": "cuda"}).policy.residual == "bf16"
    assert load_config(None, {"param_dtype": "bf16"}).policy.residual == "bf16"
    kept = load_config(None, {"param_dtype": "bf16", "residual_dtype": "fp32"}).policy
    assert kept == precision("cpu", "bf16", residual="fp32") and kept.residual == "fp32"
    toml = tmp_path / "run.toml"
    toml.write_text('[precision]\nparams = "bf16"\nresidual = "fp32"\n')
    assert load_config(str(toml), {}).policy == kept
    with pytest.raises(ConfigError, match="residual_dtype"):
        load_config(None, {"residual_dtype": "fp16"})
    with pytest.raises(ConfigError, match="residual dtype bf16 on cpu with fp32 weights"):
        load_config(None, {"residual_dtype": "bf16"}).check()
    r = tetrad_cmd("train", "--residual-dtype", "bf16", "--run-dir", str(tmp_path / "run"))
    assert_one_line_error(r, "--param-dtype bf16", "--residual-dtype auto or fp32")


class Fp32Writes(TorchDispatchMode):
    """Counts the fp32 tensors of ``numel`` elements that aten ops return while active."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.float32:
            self.count += out.numel() == self.numel and func._overloadpacket.__name__ != "detach"
        return out


def test_bf16_rmsnorm_is_autograds_without_fp32_copies_and_compiles_whole():
    """RMSNorm of a bf16 stream (:class:`tetrad.parallel.norm._NarrowApply` and ``_SquareSum``):
    output and gradients equal plain autograd's on the same operations bit for bit; no aten op
    of the apply's forward returns an fp32 tensor of the activation's size (on CUDA none
    exists: its products are rounded as they are written); and torch.compile traces it whole
    (``fullgraph``: an op Dynamo cannot trace in its backward left it eager in every compiled
    block; the sixth H200 lease measured the compiled llama-1b step 8% slower with the bf16
    stream)."""
    from tetrad.parallel.norm import _apply, _NarrowApply, _SquareSum

    torch.manual_seed(0)
    x = torch.randn(2, 24, 64).bfloat16()
    w, g = torch.rand(64) + 0.5, torch.randn(2, 24, 64).bfloat16()

    def norm(x, w):
        rstd = torch.rsqrt(_SquareSum.apply(x) / 64 + 1e-5)
        return _NarrowApply.apply(x, rstd, w, torch.bfloat16)

    def plain(x, w):
        rstd = torch.rsqrt(x.float().pow(2).sum(-1, keepdim=True) / 64 + 1e-5)
        return ((x * rstd).type_as(x) * w).to(torch.bfloat16)

    results = []
    for f in (plain, norm, torch.compile(norm, fullgraph=True, backend="aot_eager")):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = f(xi, wi)
        y.backward(g)
        results.append((y, xi.grad, wi.grad))
    for got in results[1:]:
        for a, b in zip(got, results[0], strict=True):
            assert torch.equal(a, b)
    rstd = torch.rsqrt(x.float().pow(2).sum(-1, keepdim=True) / 64 + 1e-5)
    with torch.no_grad(), Fp32Writes(x.numel()) as seen:
        _apply(x, rstd, w, torch.bfloat16)
    assert seen.count == 0

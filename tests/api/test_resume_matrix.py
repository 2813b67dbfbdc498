"""Resume-equivalence matrix: every resumable kind in torch resumes bit-identically.

For each case there is an uninterrupted reference run of ``K2 + M`` steps, and a run
that saves at ``K1`` and ``K2``. Then, through the public API only:

* ``resume``: freshly built objects restore the newest step (``K2``) and continue ``M`` steps;
* ``restore_twice``: freshly built objects restore the newest step twice in a row, then continue;
* ``rollback``: freshly built objects restore ``step=K1`` and continue ``M`` steps;
* ``rollback_in_place``: the run that saved (now at ``K2``) restores ``step=K1`` into its own
  live objects (longer histories than the checkpoint's) and continues ``M`` steps.

Every observation (each tensor of every ``state_dict()``, ``get_last_lr()``, the optimizer's
learning rates, RNG states, and every step's output: loss or draws) must equal the reference
run's bit for bit, types included. Fresh objects are built from another seed, and each test
first checks that they differ from the reference, so a restore that loads nothing fails.

Cases are discovered by introspection, so a new torch release's additions are covered: every
`torch.optim.Optimizer` subclass in `torch.optim` (with ``foreach=False``/``foreach=True``/
``fused=True`` variants where the constructor takes them; a variant that cannot run on this
CPU build is skipped with the exception as the reason), every `LRScheduler` in
`torch.optim.lr_scheduler` and `torch.optim.swa_utils` (and `ReduceLROnPlateau`), every numpy
`BitGenerator`. A class the tables below do not know is built from the optimizer (or its
parameters) alone when its signature allows it; otherwise its test fails and asks for an entry.
`NOT_RESTORABLE` lists, with the reason, the discovered classes that cannot be restored by
construction; they are reported as skipped, never dropped silently.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations, parametrize
from torch.optim import lr_scheduler, swa_utils

import tiercheck
from tests.helpers.assertions import same

K1, K2, M = 2, 4, 3  # save after K1 and K2 steps, continue M steps
SEED, OTHER_SEED = 0, 1  # the saved run and the reference use SEED; fresh objects OTHER_SEED
MODES = ("resume", "restore_twice", "rollback", "rollback_in_place")

# Discovered classes that cannot be restored by construction, with the reason.
NOT_RESTORABLE: dict[str, str] = {
    "torch.optim.Optimizer": "abstract base class: step() is not implemented, nothing to train",
    "torch.optim.lr_scheduler.LRScheduler": "abstract base class: get_lr() is not implemented",
    "torch.optim.lr_scheduler._LRScheduler": "deprecated alias of the abstract LRScheduler",
}


# ----------------------------------------------------------------------------- harness


@dataclass
class Run:
    """One training setup built by a case: its objects, one step, and what must match."""

    state: Callable[[], dict[str, Any]]  # the mapping to save, and the template to restore into
    step: Callable[[int], object]  # advance by one step (index i); returns the step's output
    observe: Callable[[], dict[str, Any]]  # everything that must equal the reference run
    load: Callable[[dict[str, Any]], None] = lambda restored: None  # after restore (plain RNG values)


@dataclass(frozen=True)
class Case:
    id: str
    build: Callable[[int], Run]  # seed -> a freshly built Run
    may_not_run_here: bool = False  # a foreach/fused variant: failing to build or step skips it
    not_restorable: str | None = None  # a NOT_RESTORABLE reason: reported as a skip


@dataclass
class Trace:
    """A run's observations after steps first_step .. first_step+n and the outputs between."""

    first_step: int
    observations: list[dict[str, Any]] = field(default_factory=list)
    outputs: list[object] = field(default_factory=list)


def snapshot(value: object) -> Any:
    """A deep copy that shares no memory with the live objects (state_dict() aliases them)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, Mapping):
        return {k: snapshot(v) for k, v in value.items()}
    if isinstance(value, list):
        return [snapshot(v) for v in value]
    if isinstance(value, tuple):
        return tuple(snapshot(v) for v in value)
    return value


def assert_same_run(actual: Trace, expected: Trace) -> None:
    """Bit-exact equality of two traces: every tensor, float, list and tuple, types included."""
    assert actual.first_step == expected.first_step
    assert len(actual.observations) == len(expected.observations)
    assert len(actual.outputs) == len(expected.outputs)
    for j, (a, e) in enumerate(zip(actual.observations, expected.observations, strict=True)):
        same(a, e, f"after step {actual.first_step + j}")
    for j, (a, e) in enumerate(zip(actual.outputs, expected.outputs, strict=True)):
        same(a, e, f"output of step {actual.first_step + j}")


def differs(a: object, b: object) -> bool:
    try:
        same(a, b)
    except AssertionError:
        return True
    return False


def continue_run(run: Run, start: int, steps: int) -> Trace:
    trace = Trace(start, [snapshot(run.observe())])
    for i in range(start, start + steps):
        trace.outputs.append(snapshot(run.step(i)))
        trace.observations.append(snapshot(run.observe()))
    return trace


@dataclass
class Prepared:
    """What the modes of one case share: the reference trace and the saved steps."""

    reference: Trace
    directory: Path  # a local tier holding steps K1 and K2, only read from here on
    saved: Run | None  # the run that saved, now at step K2 (rollback_in_place takes it)


def prepare(case: Case, directory: Path) -> Prepared:
    reference = continue_run(case.build(SEED), 0, K2 + M)
    with tiercheck.Checkpointer(local=directory, keep_local=None) as ckpt:
        saved = case.build(SEED)
        for i in range(K2):
            saved.step(i)
            if i + 1 in (K1, K2):
                ckpt.save(i + 1, saved.state())
        ckpt.wait()
        assert ckpt.steps() == [K1, K2]
    return Prepared(reference, directory, saved)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Case], Prepared]:
    """Each case is run and saved once; its four modes restore from the same steps."""
    root = tmp_path_factory.mktemp("resume_matrix")
    cache: dict[str, Prepared | tuple[Callable[[str], Any], str]] = {}

    def get(case: Case) -> Prepared:
        if case.id not in cache:
            if case.may_not_run_here:
                try:
                    continue_run(case.build(SEED), 0, 1)
                except Exception as exc:
                    reason = f"{case.id} does not run on CPU with torch {torch.__version__}: {exc!r}"
                    cache[case.id] = (pytest.skip, reason)
            if case.id not in cache:
                # stays if prepare() raises: the first mode shows the error, the others fail too
                cache[case.id] = (pytest.fail, f"preparing {case.id} failed in an earlier mode")
                cache[case.id] = prepare(case, root / case.id)
        got = cache[case.id]
        if isinstance(got, tuple):
            outcome, reason = got
            outcome(reason)
            raise AssertionError("unreachable")
        return got

    return get


def check_resume(case: Case, mode: str, prepared: Callable[[Case], Prepared]) -> None:
    if case.not_restorable is not None:
        pytest.skip(f"{case.id} is not restorable by construction: {case.not_restorable}")
    prep = prepared(case)
    reference = prep.reference
    start = K2 if mode in ("resume", "restore_twice") else K1
    if mode == "rollback_in_place":
        target, prep.saved = prep.saved, None
        if target is None:  # taken by an earlier run of this test: replay the saving run's steps
            target = case.build(SEED)
            for i in range(K2):
                target.step(i)
    else:
        target = case.build(OTHER_SEED)
    # Without a restore the comparison must fail, or this case proves nothing.
    assert differs(snapshot(target.observe()), reference.observations[start]), (
        f"{case.id}: the objects to restore into already equal the reference at step {start}"
    )
    with tiercheck.Checkpointer(local=prep.directory, keep_local=None) as ckpt:
        for _ in range(2 if mode == "restore_twice" else 1):
            template = target.state()
            got = ckpt.restore(template, step=None if start == K2 else K1)
            assert got == start
            target.load(template)

    expected = Trace(start, reference.observations[start : start + M + 1], reference.outputs[start : start + M])
    assert_same_run(continue_run(target, start, M), expected)


@pytest.fixture(autouse=True)
def _private_global_rng() -> Iterator[None]:
    """Builds seed the global torch RNG; keep that from leaking into other tests."""
    with torch.random.fork_rng(devices=[]):
        yield


def never_built(seed: int) -> Run:
    raise AssertionError("a NOT_RESTORABLE case is skipped before it is built")


def _cls_path(cls: type) -> str:
    module = cls.__module__
    for public in ("torch.optim.lr_scheduler", "torch.optim.swa_utils"):
        if module == public:
            return f"{public}.{cls.__name__}"
    if module.startswith("torch.optim"):
        return f"torch.optim.{cls.__name__}"
    return f"{module}.{cls.__name__}"


def _only_first_argument_required(cls: type) -> bool:
    """Whether cls(x) works with defaults for everything after the first argument."""
    params = list(inspect.signature(cls.__init__).parameters.values())[2:]  # type: ignore[misc]
    return all(p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


# ----------------------------------------------------------------------------- models and data


def batch(i: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g)


def mlp(seed: int, bias: bool = True) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6, bias=bias), nn.Tanh(), nn.Linear(6, 2, bias=bias))


def closure_for(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> Callable[[], torch.Tensor]:
    x, y = batch(i)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    return closure


def two_groups(model: nn.Sequential, lr: float | None) -> list[dict[str, Any]]:
    second: dict[str, Any] = {"params": list(model[2].parameters())}
    if lr is not None:
        second["lr"] = lr / 2
    return [{"params": list(model[0].parameters())}, second]


def module_observation(model: nn.Module) -> dict[str, Any]:
    return {"model": model.state_dict()}


def optimizer_observation(opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"optim": opt.state_dict(), "lr": [g["lr"] for g in opt.param_groups]}


# ----------------------------------------------------------------------------- optimizers


@dataclass(frozen=True)
class OptimizerSpec:
    kwargs: dict[str, Any]
    model: str = "mlp"  # "mlp", "mlp_no_bias" (2-D parameters only) or "sparse_embedding"
    groups: bool = True  # two parameter groups, the second at half the lr
    tensor_lr: bool = False  # kwargs["lr"] given as a 0-d tensor (a new one per build)


# Constructor arguments that give each optimizer state worth restoring; "" is the plain variant.
OPTIMIZER_ARGS: dict[str, dict[str, OptimizerSpec]] = {
    "ASGD": {"": OptimizerSpec({"lr": 0.05, "t0": 1, "weight_decay": 0.01})},
    "Adadelta": {"": OptimizerSpec({"lr": 1.0, "weight_decay": 0.01})},
    "Adafactor": {"": OptimizerSpec({"lr": 0.01})},
    "Adagrad": {"": OptimizerSpec({"lr": 0.1, "lr_decay": 0.01})},
    "Adam": {
        "": OptimizerSpec({"lr": 0.01, "amsgrad": True, "weight_decay": 0.01}),
        "tensor_lr": OptimizerSpec({"lr": 0.01}, tensor_lr=True),
    },
    "AdamW": {"": OptimizerSpec({"lr": 0.01, "amsgrad": True})},
    "Adamax": {"": OptimizerSpec({"lr": 0.01})},
    "LBFGS": {
        "": OptimizerSpec({"lr": 0.5, "history_size": 3, "max_iter": 4}, groups=False),
        "strong_wolfe": OptimizerSpec(
            {"lr": 1.0, "history_size": 3, "max_iter": 4, "line_search_fn": "strong_wolfe"}, groups=False
        ),
    },
    "Muon": {"": OptimizerSpec({"lr": 0.02, "momentum": 0.9, "nesterov": True}, model="mlp_no_bias")},
    "NAdam": {"": OptimizerSpec({"lr": 0.01, "weight_decay": 0.01, "decoupled_weight_decay": True})},
    "RAdam": {"": OptimizerSpec({"lr": 0.01})},
    "RMSprop": {"": OptimizerSpec({"lr": 0.01, "momentum": 0.9, "centered": True})},
    "Rprop": {"": OptimizerSpec({"lr": 0.01})},
    "SGD": {"": OptimizerSpec({"lr": 0.1, "momentum": 0.9, "nesterov": True})},
    "SparseAdam": {"": OptimizerSpec({"lr": 0.05}, model="sparse_embedding", groups=False)},
}


def optimizer_classes() -> dict[str, type]:
    return {
        name: obj
        for name, obj in sorted(vars(torch.optim).items())
        if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)
    }


def optimizer_run(cls: type[torch.optim.Optimizer], spec: OptimizerSpec, flags: dict[str, bool], seed: int) -> Run:
    model: nn.Module
    if spec.model == "sparse_embedding":
        torch.manual_seed(seed)
        model = nn.Embedding(10, 3, sparse=True)
    else:
        model = mlp(seed, bias=spec.model != "mlp_no_bias")
    params: Any = two_groups(model, spec.kwargs.get("lr")) if spec.groups else model.parameters()  # type: ignore[arg-type]
    kwargs = dict(spec.kwargs, **flags)
    if spec.tensor_lr:
        kwargs["lr"] = torch.tensor(kwargs["lr"])
    opt = cls(params, **kwargs)

    def step(i: int) -> object:
        if isinstance(model, nn.Embedding):
            g = torch.Generator().manual_seed(2000 + i)
            idx, target = torch.randint(0, 10, (6,), generator=g), torch.randn(6, 3, generator=g)

            def closure() -> torch.Tensor:
                opt.zero_grad()
                loss = F.mse_loss(model(idx), target)
                loss.backward()
                return loss

            return opt.step(closure)
        return opt.step(closure_for(model, opt, i))

    return Run(
        state=lambda: {"model": model, "optim": opt},
        step=step,
        observe=lambda: module_observation(model) | optimizer_observation(opt),
    )


def optimizer_cases() -> list[Case]:
    cases: list[Case] = []
    for name, cls in optimizer_classes().items():
        path = _cls_path(cls)
        if path in NOT_RESTORABLE:
            cases.append(Case(name, never_built, not_restorable=NOT_RESTORABLE[path]))
            continue
        known = name in OPTIMIZER_ARGS
        specs = OPTIMIZER_ARGS.get(name)
        if specs is None:
            # Unknown to the table: built with its defaults; its test fails if that cannot work.
            specs = {"generic": OptimizerSpec({})}
        signature = inspect.signature(cls.__init__).parameters
        for variant, spec in specs.items():
            flag_sets: list[tuple[str, dict[str, bool]]] = [("", {})]
            if "foreach" in signature:
                flag_sets = [("forloop", {"foreach": False})]
                if not spec.tensor_lr:  # torch refuses a tensor lr with foreach=True unless capturable
                    flag_sets.append(("foreach", {"foreach": True}))
            if "fused" in signature:
                flag_sets.append(("fused", {"fused": True}))
            for flag_id, flags in flag_sets:
                case_id = "-".join(p for p in (name, variant, flag_id) if p)

                def build(
                    seed: int, cls: Any = cls, spec: OptimizerSpec = spec, flags: dict[str, bool] = flags, known=known
                ) -> Run:
                    try:
                        return optimizer_run(cls, spec, flags, seed)
                    except Exception as exc:
                        if not known:
                            pytest.fail(
                                f"{_cls_path(cls)} is new to the resume matrix and cannot be built from its "
                                f"parameters alone ({exc!r}): add it to OPTIMIZER_ARGS (or, with the reason, to "
                                "NOT_RESTORABLE) in tests/api/test_resume_matrix.py"
                            )
                        raise

                cases.append(Case(case_id, build, may_not_run_here=bool(flags) and flags != {"foreach": False}))
    return cases


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", optimizer_cases(), ids=lambda c: c.id)
def test_optimizer_resumes_bit_identically(case: Case, mode: str, prepared: Callable[[Case], Prepared]) -> None:
    check_resume(case, mode, prepared)


# ----------------------------------------------------------------------------- LR schedulers

SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


class CountingFactor:
    """A stateful lr_lambda: LambdaLR saves a callable object's __dict__ (a growing list here)."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.calls = 0
        self.epochs: list[int] = []

    def __call__(self, epoch: int) -> float:
        self.calls += 1
        self.epochs.append(epoch)
        return float(self.decay**self.calls)


class CycleScale:
    """A callable-object scale_fn: CyclicLR saves its __dict__."""

    def __init__(self) -> None:
        self.base = 0.7

    def __call__(self, x: float) -> float:
        return float(self.base**x)


# Steps ReduceLROnPlateau sees as its metric: improvements, then plateaus that trigger reductions.
PLATEAU_METRICS = (1.0, 0.9, 0.9, 0.9, 0.9, 0.5, 0.5, 0.5, 0.5, 0.5)

# How to build each scheduler (keyed by class name, then variant; "" is the plain variant).
# Lambdas are not saved in state_dict(): the fresh objects rebuild them here.
SCHEDULER_FACTORIES: dict[str, dict[str, SchedulerFactory]] = {
    "ChainedScheduler": {
        "": lambda opt: lr_scheduler.ChainedScheduler(
            [lr_scheduler.ConstantLR(opt, factor=0.5, total_iters=3), lr_scheduler.ExponentialLR(opt, gamma=0.9)],
            optimizer=opt,
        )
    },
    "ConstantLR": {"": lambda opt: lr_scheduler.ConstantLR(opt, factor=0.5, total_iters=3)},
    "CosineAnnealingLR": {"": lambda opt: lr_scheduler.CosineAnnealingLR(opt, T_max=4, eta_min=0.001)},
    "CosineAnnealingWarmRestarts": {
        "": lambda opt: lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=2, T_mult=2, eta_min=0.001)
    },
    "CyclicLR": {
        "": lambda opt: lr_scheduler.CyclicLR(opt, base_lr=0.01, max_lr=0.1, step_size_up=2, mode="triangular2"),
        "scale_fn_object": lambda opt: lr_scheduler.CyclicLR(
            opt, base_lr=0.01, max_lr=0.1, step_size_up=2, scale_fn=CycleScale(), scale_mode="iterations"
        ),
    },
    "ExponentialLR": {"": lambda opt: lr_scheduler.ExponentialLR(opt, gamma=0.8)},
    "LambdaLR": {
        "": lambda opt: lr_scheduler.LambdaLR(opt, [lambda e: 0.9**e, lambda e: 1 / (1 + e)]),
        "callable_object": lambda opt: lr_scheduler.LambdaLR(opt, [CountingFactor(0.9), CountingFactor(0.8)]),
    },
    "LinearLR": {"": lambda opt: lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=4)},
    "MultiStepLR": {"": lambda opt: lr_scheduler.MultiStepLR(opt, milestones=[2, 5], gamma=0.5)},
    "MultiplicativeLR": {"": lambda opt: lr_scheduler.MultiplicativeLR(opt, lambda e: 0.95)},
    "OneCycleLR": {"": lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=K2 + M + 3)},
    "PolynomialLR": {"": lambda opt: lr_scheduler.PolynomialLR(opt, total_iters=5, power=2.0)},
    "ReduceLROnPlateau": {"": lambda opt: lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=1, cooldown=1)},
    "SequentialLR": {
        "": lambda opt: lr_scheduler.SequentialLR(
            opt,
            [lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=2), lr_scheduler.ExponentialLR(opt, gamma=0.9)],
            milestones=[3],
        )
    },
    "StepLR": {"": lambda opt: lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)},
    "SWALR": {"": lambda opt: swa_utils.SWALR(opt, swa_lr=0.05, anneal_epochs=3, anneal_strategy="linear")},
}


def scheduler_classes() -> dict[str, type]:
    found: dict[str, type] = {}
    for namespace in (lr_scheduler, swa_utils):
        for _name, obj in sorted(vars(namespace).items()):
            if isinstance(obj, type) and issubclass(obj, (lr_scheduler.LRScheduler, lr_scheduler.ReduceLROnPlateau)):
                found.setdefault(_cls_path(obj), obj)
    return found


# Schedulers also run over an optimizer whose lr is a tensor (schedulers then fill it in place).
TENSOR_LR_SCHEDULERS = ("LambdaLR", "SequentialLR", "StepLR")


def scheduler_run(factory: SchedulerFactory, seed: int, tensor_lr: bool = False) -> Run:
    model = mlp(seed)
    if tensor_lr:
        groups = [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters())}]
        opt = torch.optim.SGD(groups, lr=torch.tensor(0.1), momentum=0.9)
    else:
        opt = torch.optim.SGD(two_groups(model, 0.1), lr=0.1, momentum=0.9)
    sched = factory(opt)

    def step(i: int) -> object:
        loss = opt.step(closure_for(model, opt, i))
        if isinstance(sched, lr_scheduler.ReduceLROnPlateau):
            sched.step(PLATEAU_METRICS[i])
        else:
            sched.step()
        return loss

    return Run(
        state=lambda: {"model": model, "optim": opt, "sched": sched},
        step=step,
        observe=lambda: (
            module_observation(model)
            | optimizer_observation(opt)
            | {"sched": sched.state_dict(), "last_lr": sched.get_last_lr()}
        ),
    )


def scheduler_cases() -> list[Case]:
    cases: list[Case] = []
    for path, cls in scheduler_classes().items():
        name = cls.__name__
        if path in NOT_RESTORABLE:
            cases.append(Case(name, never_built, not_restorable=NOT_RESTORABLE[path]))
            continue
        factories = SCHEDULER_FACTORIES.get(name)
        if factories is None:
            if _only_first_argument_required(cls):
                factories = {"generic": cls}
            else:

                def unknown(opt: torch.optim.Optimizer, path: str = path) -> Any:
                    pytest.fail(
                        f"{path} is new to the resume matrix and needs constructor arguments: add it to "
                        "SCHEDULER_FACTORIES (or, with the reason, to NOT_RESTORABLE) in tests/api/test_resume_matrix.py"
                    )

                factories = {"": unknown}
        for variant, factory in factories.items():
            case_id = f"{name}-{variant}" if variant else name
            cases.append(Case(case_id, lambda seed, factory=factory: scheduler_run(factory, seed)))
        if name in TENSOR_LR_SCHEDULERS:
            plain = factories[""]
            cases.append(Case(f"{name}-tensor_lr", lambda seed, f=plain: scheduler_run(f, seed, tensor_lr=True)))
    return cases


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", scheduler_cases(), ids=lambda c: c.id)
def test_scheduler_resumes_bit_identically(case: Case, mode: str, prepared: Callable[[Case], Prepared]) -> None:
    check_resume(case, mode, prepared)


# ----------------------------------------------------------------------------- GradScaler, SWA


def grad_scaler_run(seed: int) -> Run:
    model = mlp(seed)
    opt = torch.optim.SGD(two_groups(model, 0.1), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)

    def step(i: int) -> object:
        x, y = batch(i)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        if i in (1, K2 + 1):  # an overflow: the step is skipped and the scale backs off
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    return Run(
        state=lambda: {"model": model, "optim": opt, "scaler": scaler},
        step=step,
        observe=lambda: (
            module_observation(model)
            | optimizer_observation(opt)
            | {"scaler": scaler.state_dict(), "scale": scaler.get_scale()}
        ),
    )


def bn_mlp(seed: int, momentum: float | None = 0.1) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6, momentum=momentum), nn.Tanh(), nn.Linear(6, 2))


def swa_run(seed: int, ema: bool) -> Run:
    model = bn_mlp(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if ema:
        averaged = swa_utils.AveragedModel(model, multi_avg_fn=swa_utils.get_ema_multi_avg_fn(0.9))
    else:
        averaged = swa_utils.AveragedModel(model, use_buffers=True)
    swa_sched = swa_utils.SWALR(opt, swa_lr=0.05, anneal_epochs=3)
    probe = batch(10_000)[0]

    def step(i: int) -> object:
        loss = opt.step(closure_for(model, opt, i))
        averaged.update_parameters(model)
        swa_sched.step()
        return loss

    def observe() -> dict[str, Any]:
        averaged.eval()
        out = averaged(probe).detach()
        averaged.train()
        return (
            module_observation(model)
            | optimizer_observation(opt)
            | {"averaged": averaged.state_dict(), "averaged_out": out}
            | {"swa_sched": swa_sched.state_dict(), "last_lr": swa_sched.get_last_lr()}
        )

    return Run(
        state=lambda: {"model": model, "optim": opt, "averaged": averaged, "swa_sched": swa_sched},
        step=step,
        observe=observe,
    )


AMP_AND_SWA_CASES = [
    Case("GradScaler", grad_scaler_run),
    Case("AveragedModel-SWALR", lambda seed: swa_run(seed, ema=False)),
    Case("AveragedModel-ema-SWALR", lambda seed: swa_run(seed, ema=True)),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", AMP_AND_SWA_CASES, ids=lambda c: c.id)
def test_amp_and_swa_resume_bit_identically(case: Case, mode: str, prepared: Callable[[Case], Prepared]) -> None:
    check_resume(case, mode, prepared)


# ----------------------------------------------------------------------------- modules with buffers, parametrizations


class Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


class RunningScale(nn.Module):
    """A custom parametrization with a buffer updated by every training forward."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen += 1
        return x / (1.0 + 0.1 * self.seen)


def parametrized_mlp(seed: int, wrap: Callable[[nn.Linear], nn.Module]) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), wrap(nn.Linear(6, 6)), nn.Tanh(), nn.Linear(6, 2))


def custom_parametrizations(lin: nn.Linear) -> nn.Linear:
    parametrize.register_parametrization(lin, "weight", Symmetric())
    parametrize.register_parametrization(lin, "weight", RunningScale())
    return lin


MODULES: dict[str, Callable[[int], nn.Sequential]] = {
    "BatchNorm1d": lambda seed: bn_mlp(seed),
    "BatchNorm1d-cumulative": lambda seed: bn_mlp(seed, momentum=None),  # uses num_batches_tracked
    "parametrize-custom": lambda seed: parametrized_mlp(seed, custom_parametrizations),
    "parametrizations.orthogonal": lambda seed: parametrized_mlp(seed, parametrizations.orthogonal),
    "parametrizations.weight_norm": lambda seed: parametrized_mlp(seed, parametrizations.weight_norm),
    "parametrizations.spectral_norm": lambda seed: parametrized_mlp(seed, parametrizations.spectral_norm),
    "utils.spectral_norm": lambda seed: parametrized_mlp(seed, nn.utils.spectral_norm),  # hooks, not parametrize
}


def module_run(make: Callable[[int], nn.Sequential], seed: int) -> Run:
    model = make(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    probe = batch(10_000)[0]

    def observe() -> dict[str, Any]:
        model.eval()
        out = model(probe).detach()
        model.train()
        return module_observation(model) | optimizer_observation(opt) | {"eval_out": out}

    return Run(
        state=lambda: {"model": model, "optim": opt},
        step=lambda i: opt.step(closure_for(model, opt, i)),
        observe=observe,
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "case",
    [Case(name, lambda seed, make=make: module_run(make, seed)) for name, make in MODULES.items()],
    ids=lambda c: c.id,
)
def test_module_resumes_bit_identically(case: Case, mode: str, prepared: Callable[[Case], Prepared]) -> None:
    check_resume(case, mode, prepared)


# ----------------------------------------------------------------------------- RNGs


class RandomState:
    """A stateful wrapper around an RNG's get/set state functions."""

    def __init__(self, get: Callable[[], Any], put: Callable[[Any], None]) -> None:
        self.get, self.put = get, put

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.get()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.put(sd["state"])


def rng_run(get: Callable[[], Any], put: Callable[[Any], None], draw: Callable[[], object], wrapped: bool) -> Run:
    if wrapped:
        wrapper = RandomState(get, put)
        return Run(state=lambda: {"rng": wrapper}, step=lambda i: draw(), observe=lambda: {"rng": get()})
    return Run(
        state=lambda: {"rng": get()},
        step=lambda i: draw(),
        observe=lambda: {"rng": get()},
        load=lambda restored: put(restored["rng"]),
    )


def python_random(seed: int, wrapped: bool) -> Run:
    rng = random.Random(seed)

    def draw() -> object:  # gauss() leaves a cached value in the state; getrandbits a long int
        return (rng.random(), rng.gauss(0.0, 1.0), rng.getrandbits(100), rng.randrange(10**30))

    return rng_run(rng.getstate, rng.setstate, draw, wrapped)


def numpy_random_state(seed: int, wrapped: bool) -> Run:
    rs = np.random.RandomState(seed)

    def draw() -> object:  # standard_normal() leaves a cached gaussian in the legacy state
        return (rs.random_sample(3), rs.standard_normal(), rs.randint(0, 2**62, dtype=np.int64))

    return rng_run(rs.get_state, rs.set_state, draw, wrapped)


def numpy_generator(bit_generator: type, seed: int, wrapped: bool) -> Run:
    gen = np.random.Generator(bit_generator(seed))

    def put(state: Any) -> None:
        gen.bit_generator.state = state

    def draw() -> object:  # an int32 draw leaves a buffered half word (has_uint32, uinteger)
        return (gen.random(3), gen.standard_normal(), gen.integers(0, 2**62), gen.integers(0, 100, dtype=np.int32))

    return rng_run(lambda: gen.bit_generator.state, put, draw, wrapped)


def torch_generator(seed: int, wrapped: bool) -> Run:
    g = torch.Generator().manual_seed(seed)

    def draw() -> object:
        return (
            torch.randn(3, generator=g),
            torch.randint(0, 1000, (2,), generator=g),
            torch.rand(2, dtype=torch.float64, generator=g),
            torch.normal(0.0, 1.0, (1,), generator=g),
        )

    return rng_run(g.get_state, g.set_state, draw, wrapped)


def torch_global_rng(seed: int, wrapped: bool) -> Run:
    torch.manual_seed(seed)  # the module's fixture forks the global RNG around each test
    return rng_run(
        torch.get_rng_state, torch.set_rng_state, lambda: (torch.randn(3), torch.randint(0, 9, (2,))), wrapped
    )


def numpy_bit_generators() -> dict[str, type]:
    return {
        name: obj
        for name, obj in sorted(vars(np.random).items())
        if isinstance(obj, type) and issubclass(obj, np.random.BitGenerator) and obj is not np.random.BitGenerator
    }


def rng_cases() -> list[Case]:
    makers: dict[str, Callable[[int, bool], Run]] = {
        "random.Random": python_random,
        "np.random.RandomState": numpy_random_state,
        "torch.Generator": torch_generator,
        "torch.global_rng": torch_global_rng,
    }
    for name, bg in numpy_bit_generators().items():
        makers[f"np.random.Generator-{name}"] = lambda seed, wrapped, bg=bg: numpy_generator(bg, seed, wrapped)
    return [
        Case(f"{name}-{'stateful' if wrapped else 'plain'}", lambda seed, make=make, w=wrapped: make(seed, w))
        for name, make in makers.items()
        for wrapped in (False, True)
    ]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", rng_cases(), ids=lambda c: c.id)
def test_rng_resumes_bit_identically(case: Case, mode: str, prepared: Callable[[Case], Prepared]) -> None:
    check_resume(case, mode, prepared)


# ----------------------------------------------------------------------------- the lists stay honest


def _resolve(path: str) -> object:
    module_name, _, attr = path.rpartition(".")
    module: Any = torch.optim if module_name == "torch.optim" else getattr(torch.optim, module_name.split(".")[-1])
    return getattr(module, attr)


@pytest.mark.parametrize("path", sorted(NOT_RESTORABLE))
def test_not_restorable_entries_still_exist_in_torch(path: str) -> None:
    try:
        obj = _resolve(path)
    except AttributeError:
        pytest.fail(f"{path} is gone from torch {torch.__version__}: drop it from NOT_RESTORABLE")
    assert isinstance(obj, type)
    assert path in {_cls_path(c) for c in (*optimizer_classes().values(), *scheduler_classes().values())}


def test_tables_name_only_classes_that_exist() -> None:
    optimizers, schedulers = optimizer_classes(), {c.__name__ for c in scheduler_classes().values()}
    assert sorted(set(OPTIMIZER_ARGS) - set(optimizers)) == []
    assert sorted(set(SCHEDULER_FACTORIES) - schedulers) == []
    assert sorted(set(TENSOR_LR_SCHEDULERS) - set(SCHEDULER_FACTORIES)) == []


def test_discovery_finds_the_known_classes() -> None:
    """Introspection itself works: the classes the issue names are found (a new torch only adds)."""
    optimizers = set(optimizer_classes())
    assert {"SGD", "Adam", "AdamW", "LBFGS", "SparseAdam"} <= optimizers
    schedulers = {c.__name__ for c in scheduler_classes().values()}
    assert {"SequentialLR", "ChainedScheduler", "ReduceLROnPlateau", "OneCycleLR", "CyclicLR", "SWALR"} <= schedulers
    assert {"PCG64", "MT19937"} <= set(numpy_bit_generators())

"""What a run is made of: an `Experiment` (what every run of a comparison or sweep shares) and
a `RunSpec` (one run of it: variant, concurrency), paired as a `Run`, which `engine.runtime`
replays and `vtoken.cache` keys. Nothing else builds a run from another one."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from vtoken import defaults
from vtoken.errors import ConfigError
from vtoken.engine.batch_limits import vllm_batch_defaults
from vtoken.engine.sim import SimProfile
from vtoken.hardware import GpuSpec
from vtoken.kv.reclaim import ReclaimConfig
from vtoken.model_spec import ModelSpec
from vtoken.policies import POLICIES
from vtoken.policies.base import Budget

VARIANTS = ("native", "naive-evict", "vtoken")


@dataclass(frozen=True)
class EvictionConfig:
    """Which tokens go: the policy, its budget, and when it runs.

    A request runs the policy right after its prefill and then every `interval_tokens`
    generated tokens, always on its state at that exact length, so every variant makes the
    same decisions whatever its timing.
    """

    policy: str = defaults.POLICY
    budget: Budget = field(default_factory=lambda: Budget.parse(defaults.BUDGET))
    interval_tokens: int = defaults.EVICTION_INTERVAL_TOKENS

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown policy '{self.policy}'; choose one of: {', '.join(POLICIES)}")
        if self.interval_tokens <= 0:
            raise ConfigError(f"eviction interval must be > 0 tokens, got {self.interval_tokens}")


@dataclass(frozen=True)
class SchedulerConfig:
    """vLLM V1's scheduler limits, named as vllm/config/scheduler.py names them (engine/scheduler.py
    schedules with them). None: what `vllm serve` takes on the experiment's GPU
    (engine/batch_limits.py), filled in by `Experiment.with_scheduler_defaults`."""

    max_num_batched_tokens: int | None = None  # token budget of one step: decodes first, then prompt chunks
    max_num_seqs: int | None = None  # most running requests
    enable_chunked_prefill: bool = defaults.ENABLE_CHUNKED_PREFILL  # a prompt may be split across steps
    long_prefill_token_threshold: int = defaults.LONG_PREFILL_TOKEN_THRESHOLD  # cap of one chunk (0: none)
    evict_every_chunk: bool = False  # the policy also runs after each prompt chunk (policies without scores)

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")

    def with_defaults(self, gpu: GpuSpec) -> SchedulerConfig:
        """These limits, each one left None set to what `vllm serve` takes on `gpu`."""
        if self.max_num_batched_tokens is not None and self.max_num_seqs is not None:
            return self
        limits = vllm_batch_defaults(gpu)
        return replace(self, max_num_batched_tokens=self.max_num_batched_tokens or limits.max_num_batched_tokens,
                       max_num_seqs=self.max_num_seqs or limits.max_num_seqs)


@dataclass(frozen=True)
class Experiment:
    """What every run of a comparison or sweep shares: the model on its GPU, the KV block
    budget, what eviction and reclamation do, the scheduler's limits, the seed and the cost
    model. `experiment.run(variant, concurrency)` is one run of it."""

    model: ModelSpec
    gpu: GpuSpec
    num_blocks: int
    block_size: int = defaults.BLOCK_SIZE
    eviction: EvictionConfig = field(default_factory=EvictionConfig)
    reclaim: ReclaimConfig = field(default_factory=ReclaimConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int = defaults.SEED
    sim: SimProfile = field(default_factory=SimProfile)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ConfigError(f"block size must be > 0 tokens, got {self.block_size}")
        if self.num_blocks <= 0:
            raise ConfigError(f"the KV budget must be > 0 blocks, got {self.num_blocks}")
        if self.scheduler.evict_every_chunk and POLICIES[self.eviction.policy].needs_attention:
            raise ConfigError(f"--evict-every-chunk: {self.eviction.policy} ranks tokens by the attention the whole "
                              f"prompt's queries paid; it runs after a prompt's last chunk only (policies that can: "
                              f"{', '.join(n for n, p in POLICIES.items() if not p.needs_attention)})")

    def with_scheduler_defaults(self) -> Experiment:
        """The experiment with every scheduler limit left None set to vLLM's default on `gpu`."""
        scheduler = self.scheduler.with_defaults(self.gpu)
        return self if scheduler is self.scheduler else replace(self, scheduler=scheduler)

    def run(self, variant: str, concurrency: int | None, *, admit_all_at_start: bool = False) -> Run:
        """One run of this experiment: `variant` with `concurrency` closed-loop clients (None:
        open loop, by the trace's timestamps)."""
        return Run(self, RunSpec(variant, concurrency, admit_all_at_start))


class VariantRole:
    """What a variant does: `naive-evict` and `vtoken` evict, only `vtoken` reclaims. Mixed into
    every configuration that names a `variant`."""

    variant: str

    @property
    def evicts(self) -> bool:
        return self.variant != "native"

    @property
    def reclaims(self) -> bool:
        return self.variant == "vtoken"


@dataclass(frozen=True)
class RunSpec(VariantRole):
    """One run of an experiment: which variant, and how requests arrive."""

    variant: str
    concurrency: int | None  # closed loop with C clients; None = open loop by timestamps
    admit_all_at_start: bool = False  # capacity frontier: every request resident from t = 0

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ConfigError(f"unknown variant '{self.variant}'; choose one of: {', '.join(VARIANTS)}")
        if self.concurrency is not None and self.concurrency <= 0:
            raise ConfigError(f"concurrency must be > 0, got {self.concurrency}")


@dataclass(frozen=True)
class Run:
    """An experiment and one run of it: what the runtime replays, and what a replay's result
    (and its cache key) is determined by, with the requests."""

    experiment: Experiment
    spec: RunSpec

    def with_variant(self, variant: str) -> Run:
        """The same run with `variant` (the variants of one point of a sweep or comparison)."""
        return Run(self.experiment, replace(self.spec, variant=variant))

"""Training workloads on the simulated allocator: the same allocation pattern a real trainer has.

A step is: forward (activations allocated layer by layer, with transient workspaces between
them), backward (layer by layer in reverse: the layer's gradients appear, its activations go),
optimizer step (Adam state created on the first step, a few temporaries), then the step
boundary with the gradients alive; zero_grad (set_to_none=True: gradients freed) opens the
next step.  The work is paced over the step time, so an observer
sees mid-step states as it would on a busy GPU.  The scenarios bend that pattern the way real
bugs and real data do:

- healthy:  fixed shapes; a clean sawtooth that returns to the same baseline every step;
- leak:     the loss is kept with its graph every step (`losses.append(loss)`), pinning a fixed
            number of bytes per step (`leak_bytes_per_step`): the baseline climbs steadily;
- fragment: ragged batches of many medium (1-10 MiB) activations, plus per-layer outputs kept
            for a few steps and allocated between the activations: freed activations leave
            split segments around them (fragmentation gauge ~0.2-0.4; ~0 with
            expandable_segments);
- pressure: a model sized to run at 95-99 % of the device with variable sequence lengths, so
            the allocator keeps hitting the free-cache-and-retry path (and may OOM);
- oom:      the batch grows 25 % a step until a step runs out of memory, then halves (the
            H100 recording's `train_gpt.py --mode oom`): OOMs in forward, over and over.

Two more are not trainers (ServerWorkload): an inference server like vLLM, which takes its share
of the GPU when it starts and serves request bursts out of it with no optimizer step (`server`),
and the same server whose memory beyond its share grows until the allocator retries and runs
out (`server-overrun`).
"""

from __future__ import annotations

import contextlib
import itertools
import random
from collections import deque
from collections.abc import Callable

from memtop.agent import stacks
from memtop.agent.probe import Breakdown
from memtop.base.records import record
from memtop.sim.allocator import SimulatedCachingAllocator, SimulatedOutOfMemoryError
from memtop.sim.device import publish_so_far, published_once
from memtop.sim.scenario_names import TRAINER_SCENARIOS

MiB = 1 << 20
GiB = 1 << 30

SCENARIOS = TRAINER_SCENARIOS
SERVER_SCENARIOS = ("server", "server-overrun")
OOM_GROWTH = 1.25  # the oom scenario's batch growth per step


@record(frozen=True)
class ModelShape:
    """A transformer-ish model: `layers` blocks of `params_per_layer` bytes (fp32)."""

    layers: int
    params_per_layer: int  # bytes of parameters per layer, split over 4 tensors
    activation_per_layer: int  # bytes of activations per layer at the base sequence length
    embedding: int  # bytes of the embedding table


def model_for(scenario: str, total_bytes: int, scale: float = 1.0) -> ModelShape:
    """Size the model so each scenario sits where it should on a device of `total_bytes`."""
    # Weights + grads + 2 Adam moments = 4 × parameters; activations come on top.
    if scenario == "pressure":
        static_share, activation_share = 0.72, 0.38
    elif scenario == "leak":
        static_share, activation_share = 0.30, 0.12
    elif scenario == "oom":
        static_share, activation_share = 0.30, 0.05
    elif scenario == "fragment":
        # A small model: the gauge divides by all large-pool reserved bytes, so the split
        # activation segments must not be drowned by weights (activation sizes are set apart).
        static_share, activation_share = 0.01, 0.10
    else:
        static_share, activation_share = 0.36, 0.16
    layers = 24
    params = int(total_bytes * static_share * scale / 4)
    embedding = params // 10
    per_layer = (params - embedding) // layers
    activation = int(total_bytes * activation_share * scale) // layers
    return ModelShape(layers, per_layer, activation // 6 * 6, embedding)


class Workload:
    """One trainer's memory behaviour on one simulated device."""

    def __init__(
        self,
        scenario: str,
        allocator: SimulatedCachingAllocator,
        shape: ModelShape,
        seed: int = 0,
        leak_bytes_per_step: int = 8 * MiB,
        log: Callable[[str], None] | None = None,
        pace: Callable[[], object] | None = None,
        layers_per_pause: int = 1,
    ) -> None:
        if scenario not in SCENARIOS or scenario in SERVER_SCENARIOS:
            raise ValueError(f"unknown scenario {scenario!r}; choose from {', '.join(SCENARIOS)}")
        self.scenario = scenario
        self.alloc = allocator
        self.shape = shape
        self.rng = random.Random(seed)
        self.leak_bytes_per_step = leak_bytes_per_step
        self.log = log or (lambda message: None)
        # Called after every `layers_per_pause` layers (forward and backward each visit every
        # layer), so that the step's work is spread over the step time and an observer samples
        # mid-step states, as it would on a GPU that is always busy.
        self.pace = pace or (lambda: None)
        self.layers_per_pause = max(1, layers_per_pause)
        self._visits = itertools.count(1)  # layers visited, across steps
        self.steps = 0
        self.ooms = 0
        self.batch_factor = 1.0  # the oom scenario's growing batch, relative to the first
        # Where the step is: what an OOM report's phase says (torch's probe tells backward from
        # forward by autograd's graph task and the optimizer by its step hooks).
        self.current_pass = "idle"
        self.params: list[int] = []
        self.grads: list[int] = []
        self.optimizer_state: list[int] = []
        self.retained: list[int] = []  # the leak: tensors kept alive by a user's list
        self.long_lived: deque[int] = deque()  # fragment: buffers that outlive their step
        self._param_sizes: list[int] = []
        self._step_live: set[int] = set()
        self._grad_bytes = 0
        self._build_model()

    # ------------------------------------------------------------------ model

    def _tensor_sizes(self) -> list[int]:
        # Per layer: qkv, proj, two MLP matrices (1 : 1/3 : 4/3 : 4/3 of the layer's bytes).
        per = self.shape.params_per_layer
        sizes = [self.shape.embedding]
        for _ in range(self.shape.layers):
            sizes += [per * 3 // 12, per * 1 // 12, per * 4 // 12, per * 4 // 12]
            sizes += [16 * 1024, 16 * 1024]  # layer norms: tiny, small pool
        return sizes

    def _build_model(self) -> None:
        self._param_sizes = self._tensor_sizes()
        with self._one_publish():
            self.params = [self.alloc.malloc(size) for size in self._param_sizes]

    def _one_publish(self) -> contextlib.AbstractContextManager[None]:
        # A shared simulated GPU publishes each segment reserved; a model's hundreds of
        # segments in a row are published once (SharedDeviceMemory.batch).
        return published_once(self.alloc.device)

    def _pause(self) -> None:
        """After a layer; at every `layers_per_pause`th, what was reserved and released since
        the last pause is published in one write (the GPU as it is now, for a viewer), then
        the trainer waits (pace)."""
        if next(self._visits) % self.layers_per_pause == 0:
            publish_so_far(self.alloc.device)
            self.pace()

    # ------------------------------------------------------------------ one step

    def _sequence_factor(self) -> float:
        if self.scenario == "fragment":
            return self.rng.uniform(0.3, 1.0)
        if self.scenario == "oom":
            return self.batch_factor
        if self.scenario == "pressure":
            # Sequence lengths vary batch to batch (bucketed by 64 of 2048 tokens): each new
            # length wants blocks the full cache does not have.
            return self.rng.randrange(8, 33) / 32
        return 1.0

    def step(self) -> bool:
        """Run one training step; False when it hit OOM (the batch was skipped)."""
        try:
            # The first step's ~200 new segments (and an OOM's released cache) are published a
            # layer at a time, not a write each.
            with self._one_publish():
                self._train_step()
        except SimulatedOutOfMemoryError as exc:
            self.ooms += 1
            self._recover_from_oom(exc)
            return False
        self.steps += 1
        if self.scenario == "oom":
            self.batch_factor *= OOM_GROWTH
        return True

    @stacks.plumbing  # torch's op: the site of a block is the line that called it
    def _m(self, nbytes: float) -> int:
        size = int(nbytes)
        address = self.alloc.malloc(size if size > 512 else 512)  # max(512, size), no call
        self._step_live.add(address)
        return address

    def _f(self, address: int) -> None:
        self._step_live.discard(address)
        self.alloc.free(address)

    def _layer_activation_sizes(self, factor: float) -> list[float]:
        per_tensor = self.shape.activation_per_layer / 6
        if self.scenario != "fragment":
            return [per_tensor * factor] * 6
        # Ragged batches: many medium tensors (1-10 MiB, the band served from shared 20 MiB
        # segments) whose sizes differ tensor to tensor, as attention over ragged sequences does.
        return [self.rng.uniform(1.2, 9.5) * MiB * factor for _ in range(16)]

    def _train_step(self) -> None:
        factor = self._sequence_factor()
        # zero_grad(set_to_none=True) at the top of the loop: the last step's gradients lived
        # from its backward through its optimizer step and the step boundary after it, as in a
        # real trainer, and the breakdown measured there counts them.
        for address in self.grads:
            self.alloc.free(address)
        self.grads = []
        self._grad_bytes = 0
        self._step_live = set()
        self.current_pass = "forward"
        layers: list[list[int]] = []
        # forward: the saved tensors of each layer, and a transient workspace between them
        for _layer in range(self.shape.layers):
            saved = []
            for i, size in enumerate(self._layer_activation_sizes(factor)):
                workspace = self._m(size * 0.5) if i % 4 == 0 else None
                saved.append(self._m(size))
                if workspace is not None:
                    self._f(workspace)  # leaves a hole between saved tensors
            layers.append(saved)
            if self.scenario == "fragment":
                # Per-layer outputs kept for a few steps (metrics, an EMA, a cache), allocated
                # between this layer's activations: when those are freed, each pins a
                # segment that stays split around free space.
                buffer = self._m(self.rng.uniform(1.1, 2.5) * MiB)
                self._step_live.discard(buffer)
                self.long_lived.append(buffer)
            self._pause()
        activations = [address for saved in layers for address in saved]
        per_tensor = self.shape.activation_per_layer // 6
        logits = self._m(per_tensor * 2 * factor)
        loss = self._m(512)
        # backward: activations freed in reverse, gradients allocated (set_to_none zero_grad)
        self.current_pass = "backward"
        self._f(logits)
        keep = self._leaked_tensors(activations)
        # Layer by layer in reverse: the layer's gradients appear, then its saved tensors go.
        per_layer_params = (len(self._param_sizes) - 1) // self.shape.layers
        for layer in range(self.shape.layers - 1, -1, -1):
            first = 1 + layer * per_layer_params
            for size in self._param_sizes[first : first + per_layer_params]:
                self.grads.append(self._m(size))
                self._grad_bytes += size
            for address in reversed(layers[layer]):
                if address not in keep:
                    self._f(address)
            self._pause()
        self.grads.append(self._m(self._param_sizes[0]))  # the embedding's, last
        self._grad_bytes += self._param_sizes[0]
        # optimizer step: Adam's two moments appear on the first step and stay
        self.current_pass = "optimizer"
        if not self.optimizer_state:
            with self._one_publish():
                for size in self._param_sizes:
                    self.optimizer_state.append(self.alloc.malloc(size))
                    self.optimizer_state.append(self.alloc.malloc(size))
        for size in self._param_sizes[:: max(1, len(self._param_sizes) // 8)]:
            self._f(self._m(size))  # foreach temporaries, a few at a time
        if self.scenario == "leak":
            self._step_live.discard(loss)
            self.retained.append(loss)  # `losses.append(loss)` keeps the graph alive
        else:
            self._f(loss)
        self._step_live.difference_update(self.grads)  # alive until the next zero_grad
        while len(self.long_lived) > 8 * self.shape.layers:
            self.alloc.free(self.long_lived.popleft())
        self.current_pass = "idle"

    def _leaked_tensors(self, activations: list[int]) -> set[int]:
        if self.scenario != "leak" or not activations:
            return set()
        # The kept graph pins part of this step's saved activations: one tensor of exactly
        # leak_bytes_per_step, so the scenario's true leak rate is known.
        kept = self._m(self.leak_bytes_per_step)
        self._step_live.discard(kept)
        self.retained.append(kept)
        return set()

    def _recover_from_oom(self, exc: SimulatedOutOfMemoryError) -> None:
        # What a real loop does: free what the failed step held, skip the batch.  A leaking
        # trainer really dies here; the simulation "restarts" it by dropping what it leaked.
        for address in list(self._step_live):
            self._free_quietly(address)
        self._step_live = set()
        self.grads = []
        self._grad_bytes = 0
        if self.scenario == "leak":
            self.log(f"OOM after {self.steps} steps (leak): {exc}; restarting from checkpoint")
            for address in self.retained:
                self._free_quietly(address)
            self.retained = []
        elif self.scenario == "oom":
            self.batch_factor = max(1.0, self.batch_factor / 2)
            self.log(f"OOM at step {self.steps}, batch halved: {str(exc)[:120]}")
        else:
            self.log(f"OOM at step {self.steps}, batch skipped: {str(exc)[:120]}")
        self.current_pass = "idle"

    def _free_quietly(self, address: int) -> None:
        with contextlib.suppress(ValueError):  # already freed before the OOM
            self.alloc.free(address)

    # ------------------------------------------------------------------ breakdown

    def breakdown(self, index: int) -> dict[int, Breakdown]:
        """Tensor bytes by role, as torch's storages would report them (requested sizes).

        Called from the agent thread while the trainer steps: it reads counters only.
        """
        parameters = sum(self._param_sizes)
        return {
            index: Breakdown(
                parameters=parameters,
                gradients=self._grad_bytes,
                optimizer_state=2 * parameters if self.optimizer_state else 0,
                allocated=self.alloc.memory_allocated(),
                fp32_parameter_bytes=parameters,
            )
        }


class ServerWorkload:
    """An inference server on one simulated device, as vLLM runs: at start it loads its weights,
    profiles one batch (whose activations go back to the cache), and takes the rest of its share
    of the GPU (`--gpu-memory-utilization`) as one KV cache it keeps; then each `step()` serves
    a burst of requests out of the cached activations: reserved flat at its share, no retries,
    no OOMs, and no optimizer step (memtop.step() is never called).

    `server-overrun`: after `grow_after` bursts, each burst also keeps a block beside the pool
    (a prefix cache the engine does not count): the GPU goes past the share asked for, the
    allocator flushes its cache and retries, and at the end runs out; the server then drops
    what it kept and grows again."""

    WEIGHTS_SHARE = 0.25
    ACTIVATION_SHARE = 0.04
    CHUNKS = 16
    GROWTH_SHARE = 0.01  # of the GPU kept per burst once it overruns

    def __init__(
        self,
        scenario: str,
        allocator: SimulatedCachingAllocator,
        total_bytes: int,
        share: float,
        overhead_bytes: int,
        seed: int = 0,
        grow_after: int = 40,
        log: Callable[[str], None] | None = None,
    ) -> None:
        if scenario not in SERVER_SCENARIOS:
            raise ValueError(f"not a server scenario: {scenario!r}")
        self.scenario = scenario
        self.alloc = allocator
        self.rng = random.Random(seed)
        self.grow_after = grow_after
        self.log = log or (lambda message: None)
        self.steps = 0  # request bursts served (not optimizer steps)
        self.ooms = 0
        self.current_pass = "idle"
        self.kept: list[int] = []
        with published_once(self.alloc.device):  # the server's start, in one write
            self.weights = [
                self.alloc.malloc(int(total_bytes * self.WEIGHTS_SHARE / 8)) for _ in range(8)
            ]
            self.chunk = int(total_bytes * self.ACTIVATION_SHARE / self.CHUNKS)
            profile = [self.alloc.malloc(self.chunk) for _ in range(self.CHUNKS)]
            for address in profile:
                self.alloc.free(address)  # the profiling batch: its activations stay cached
            pool = int(share * total_bytes) - overhead_bytes - self.alloc.memory_reserved()
            self.kv_cache = self.alloc.malloc(max(self.chunk, pool))

    def step(self) -> bool:
        """Serve one burst of requests; False when it ran out of memory."""
        with published_once(self.alloc.device):  # an overrun's retry frees the cache in one write
            return self._serve_burst()

    def _serve_burst(self) -> bool:
        self.current_pass = "forward"
        try:
            live = [self.alloc.malloc(self.chunk) for _ in range(self.rng.randrange(4, 17))]
            for address in live:
                self.alloc.free(address)
            if self.scenario == "server-overrun" and self.steps >= self.grow_after:
                size = int(self.GROWTH_SHARE * self.alloc.mem_get_info()[1])
                self.kept.append(self.alloc.malloc(size + self.rng.randrange(1, 64) * MiB))
        except SimulatedOutOfMemoryError as exc:
            self.ooms += 1
            self.log(f"OOM after {self.steps} bursts: {str(exc)[:120]}; dropping its prefix cache")
            for address in self.kept:
                self.alloc.free(address)
            self.kept = []
            return False
        finally:
            self.current_pass = "idle"
        self.steps += 1
        return True

    def breakdown(self, index: int) -> dict[int, Breakdown]:
        """No optimizer, no gradients: what a breakdown measures of a server (never asked at a
        step boundary, there being none)."""
        parameters = sum(self.alloc.allocation_size(a) for a in self.weights)
        return {
            index: Breakdown(
                parameters=parameters,
                gradients=0,
                optimizer_state=0,
                allocated=self.alloc.memory_allocated(),
                fp32_parameter_bytes=0,
            )
        }

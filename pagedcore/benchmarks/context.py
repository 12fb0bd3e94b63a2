"""One benchmark run's shared state: its options, the device and dtype they resolve to, and the model its
benchmarks share (built on first use, so a run of the core benchmark alone never imports torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedcore.errors import ConfigError

from .options import BenchOptions

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

__all__ = ["BenchContext"]


class BenchContext:
    """The options of a run, its device and dtype (checked on first use) and its benchmark model.

    Args:
        options: what the run is asked for.
        model: a model to benchmark instead of building one from the options (e.g. a test's tiny model).

    Example:
        >>> ctx = BenchContext(BenchOptions(quick=True, model_size="tiny"))
        >>> ctx.device, ctx.dtype
        (device(type='cpu'), torch.float32)
        >>> ctx.model() is ctx.model(), ctx.model().config.hidden_size
        (True, 64)
    """

    def __init__(self, options: BenchOptions, model: PreTrainedModel | None = None) -> None:
        self.options = options
        self._model = model
        self._device: torch.device | None = None
        self._dtype: torch.dtype | None = None

    @property
    def quick(self) -> bool:
        """Whether the run uses the quick workloads."""
        return self.options.quick

    @property
    def progress(self) -> bool:
        """Whether to show progress bars."""
        return self.options.progress

    @property
    def device(self) -> torch.device:
        """The run's device (``ConfigError`` if this machine has no such device)."""
        return self._resolve()[0]

    @property
    def dtype(self) -> torch.dtype:
        """The run's dtype (``ConfigError`` if the device cannot compute in it)."""
        return self._resolve()[1]

    def check(self) -> None:
        """Resolve the device and dtype now when the run uses a model (``ConfigError`` if they do not work here)."""
        if self.options.needs_torch:
            device, _ = self._resolve()
            if self.options.engine_compile == "cudagraphs" and device.type != "cuda":
                raise ConfigError(f"--engine-compile cudagraphs needs CUDA; the run's device is {device}")

    def _resolve(self) -> tuple[torch.device, torch.dtype]:
        if self._device is None or self._dtype is None:
            from pagedcore.cli.devices import resolve_device, resolve_dtype

            device = resolve_device(self.options.device)
            self._dtype = resolve_dtype(self.options.dtype, device)
            self._device = device
        return self._device, self._dtype

    def model(self) -> PreTrainedModel:
        """The benchmark model, built on the first call and shared by the run's benchmarks."""
        if self._model is None:
            from .common import bench_model

            self._model = bench_model(
                self.options.seed, self.dtype, size=self.options.model_size, quick=self.quick, device=self.device
            )
        return self._model

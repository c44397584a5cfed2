"""The learned output-length ranker behind the ``ltr`` and ``hybrid`` families. Pure: no vLLM import.

What the engine knows when a request arrives is its prompt size, a hash of its leading prompt
tokens (the system prompt / template, see ``WaitingRequest.prefix_hash``) and the client's
``max_tokens``. Output length mostly follows the application that sent the request, and the
leading tokens identify the application; so the ranker keeps, per prefix hash, a small
least-squares fit of ``log(1 + output tokens)`` against ``log(1 + prompt tokens)``:

* the per-key mean is shrunk towards the global mean by ``prior_weight`` pseudo-observations,
  so a key seen once does not dominate;
* the per-key slope is a ridge estimate (``ridge`` pulls it towards 0), so a template whose
  output grows with its input (summaries, translations) is ranked by size within the template;
* an unseen key falls back to the global fit;
* ``max_tokens`` (when the client sets it) caps the prediction.

State is a handful of floats per key, updated in O(1) per completed request and read in O(1)
per prediction (about a microsecond). Given the same sequence of observations the state, and
so every prediction, is the same. Old evidence fades: a key's statistics are scaled down once
they exceed ``max_weight`` observations, and at most ``max_keys`` keys are kept (the least
recently updated one is dropped).

The model is saved as JSON (``carbonforge-runtime ltr fit`` writes it from a trace).
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from carbonforge_runtime import files
from carbonforge_runtime.errors import UsageError

#: How many leading prompt tokens the engine-side prefix hash covers (the shim's ``prefix_hash``).
PREFIX_HASH_TOKENS = 64
MODEL_FORMAT = "carbonforge-ltr"
MODEL_VERSION = 1
#: A saved model holds at most max_keys keys of five numbers: a few MiB. Larger files are refused after reading no more.
MAX_MODEL_BYTES = 64 << 20
#: log(1 + 128): the prediction before anything has been observed.
_DEFAULT_LOG_OUTPUT = math.log1p(128.0)
#: The largest log prediction turned into a length (about 1e300 tokens: beyond any request).
_MAX_LOG_OUTPUT = 690.0


def prefix_hash(token_ids: Sequence[int] | None) -> int:
    """The key the ranker learns per: a hash of the first :data:`PREFIX_HASH_TOKENS` prompt token ids.

    The same function as the engine-side shim's, so a model fitted offline from a trace's
    prompt text (re-tokenized with the served model's tokenizer) uses the keys the engine sees.
    A tuple of ints hashes the same in every process (no hash randomization for ints).
    """
    return hash(tuple(token_ids[:PREFIX_HASH_TOKENS])) if token_ids else 0


@dataclass
class FitStats:
    """Weighted sufficient statistics of a one-feature least-squares fit."""

    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float) -> None:
        self.n += 1.0
        self.sx += x
        self.sy += y
        self.sxx += x * x
        self.sxy += x * y

    def scale(self, factor: float) -> None:
        self.n *= factor
        self.sx *= factor
        self.sy *= factor
        self.sxx *= factor
        self.sxy *= factor

    def as_list(self) -> list[float]:
        return [self.n, self.sx, self.sy, self.sxx, self.sxy]

    @classmethod
    def from_list(cls, values: Sequence[float]) -> FitStats:
        if (not isinstance(values, list) or len(values) != 5
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)):
            raise ValueError("statistics must be five numbers")
        numbers = [float(v) for v in values]  # OverflowError for an integer no float can hold
        if not all(math.isfinite(v) for v in numbers) or numbers[0] < 0:
            raise ValueError("statistics must be finite, with a weight >= 0")
        return cls(*numbers)


@dataclass(frozen=True)
class LtrParams:
    prior_weight: float = 4.0  # pseudo-observations of the global mean in each key's mean
    ridge: float = 2.0  # pulls each slope towards 0 (in units of centred sum of squares)
    max_weight: float = 2000.0  # a key's statistics are rescaled to this many observations at most
    max_keys: int = 4096  # keys kept; the least recently updated goes first
    use_max_tokens: bool = True  # cap predictions at the client's max_tokens

    @classmethod
    def from_mapping(cls, params: Mapping[str, Any], where: str = "ltr") -> LtrParams:
        defaults = cls()
        values: dict[str, Any] = {}
        for name in ("prior_weight", "ridge", "max_weight"):
            value = params.get(name, getattr(defaults, name))
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value) or value < 0:
                raise UsageError(f"{where}: parameter {name}={value!r} must be a number >= 0",
                                 f"fix scheduler.params.{name} in the recipe")
            values[name] = float(value)
        if values["max_weight"] < 1:
            raise UsageError(f"{where}: parameter max_weight must be at least 1",
                             "fix scheduler.params.max_weight in the recipe")
        max_keys = params.get("max_keys", defaults.max_keys)
        if isinstance(max_keys, bool) or not isinstance(max_keys, int) or max_keys < 1:
            raise UsageError(f"{where}: parameter max_keys={max_keys!r} must be a whole number >= 1",
                             "fix scheduler.params.max_keys in the recipe")
        use_max = params.get("use_max_tokens", defaults.use_max_tokens)
        if not isinstance(use_max, bool):
            raise UsageError(f"{where}: parameter use_max_tokens={use_max!r} must be true or false",
                             "fix scheduler.params.use_max_tokens in the recipe")
        return cls(values["prior_weight"], values["ridge"], values["max_weight"], max_keys, use_max)


def _finite(value: float) -> bool:
    """A finite number a float can hold (an integer of 400 digits is not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _x(prompt_tokens: int) -> float:
    return math.log1p(max(prompt_tokens, 0))


@dataclass
class LtrModel:
    """Per-prefix log-linear output-length model with a global fallback."""

    params: LtrParams = field(default_factory=LtrParams)
    global_stats: FitStats = field(default_factory=FitStats)
    keys: OrderedDict[int, FitStats] = field(default_factory=OrderedDict)
    observations: int = 0
    # Derived fits, cached between observations (a prediction is then a lookup and a multiply):
    # the global (mean, slope, x mean), and per key (mean at the key's x mean, slope, x mean),
    # None for a key never observed.
    _global_fit: tuple[float, float, float] | None = field(default=None, init=False, repr=False, compare=False)
    _key_fits: dict[int, tuple[float, float, float] | None] = field(
        default_factory=dict, init=False, repr=False, compare=False)

    def _invalidate(self) -> None:
        self._global_fit = None
        self._key_fits.clear()

    # -- learning -------------------------------------------------------------------------------
    def observe(self, prefix_hash: int, prompt_tokens: int, output_tokens: int) -> None:
        x, y = _x(prompt_tokens), math.log1p(max(output_tokens, 0))
        self.observations += 1
        self._invalidate()
        self._add(self.global_stats, x, y, self.params.max_weight * 10.0)
        stats = self.keys.get(prefix_hash)
        if stats is None:
            stats = FitStats()
            self.keys[prefix_hash] = stats
            while len(self.keys) > self.params.max_keys:
                self.keys.popitem(last=False)
        else:
            self.keys.move_to_end(prefix_hash)
        self._add(stats, x, y, self.params.max_weight)

    @staticmethod
    def _add(stats: FitStats, x: float, y: float, cap: float) -> None:
        if stats.n + 1.0 > cap:
            stats.scale((cap - 1.0) / stats.n)
        stats.add(x, y)

    # -- prediction -----------------------------------------------------------------------------
    def _global(self) -> tuple[float, float, float]:
        fit = self._global_fit
        if fit is None:
            g = self.global_stats
            if g.n <= 0.0:
                fit = (_DEFAULT_LOG_OUTPUT, 0.0, 0.0)
            else:
                fit = (g.sy / g.n, _slope(g, self.params.ridge), g.sx / g.n)
            self._global_fit = fit
        return fit

    def _key(self, prefix_hash: int) -> tuple[float, float, float] | None:
        stats = self.keys.get(prefix_hash)
        fit: tuple[float, float, float] | None = None
        if stats is not None and stats.n > 0.0:
            base, g_slope, g_xmean = self._global()
            xmean = stats.sx / stats.n
            # The key's mean, shrunk towards what the global fit predicts at the key's mean size.
            prior = self.params.prior_weight
            global_at_xmean = base + g_slope * (xmean - g_xmean)
            mean = (stats.sy + prior * global_at_xmean) / (stats.n + prior)
            fit = (mean, _slope(stats, self.params.ridge), xmean)
        if len(self._key_fits) >= 4 * self.params.max_keys:
            self._key_fits.clear()  # many unseen keys scored without any observation in between
        self._key_fits[prefix_hash] = fit
        return fit

    def predict_log(self, prefix_hash: int, prompt_tokens: int) -> float:
        """Predicted ``log(1 + output tokens)``."""
        x = math.log1p(prompt_tokens) if prompt_tokens > 0 else 0.0
        fits = self._key_fits
        fit = fits[prefix_hash] if prefix_hash in fits else self._key(prefix_hash)
        if fit is None:
            base, g_slope, g_xmean = self._global_fit or self._global()
            return base + g_slope * (x - g_xmean)
        mean, slope, xmean = fit
        return mean + slope * (x - xmean)

    def predict(self, prefix_hash: int, prompt_tokens: int, max_tokens: int | None = None) -> float:
        """Predicted output tokens (a float, >= 0)."""
        # Capped so that a model with extreme (finite) statistics predicts a huge length, not an overflow.
        value = math.expm1(min(self.predict_log(prefix_hash, prompt_tokens), _MAX_LOG_OUTPUT))
        if value < 0.0:
            return 0.0
        if max_tokens and value > max_tokens and max_tokens > 0 and self.params.use_max_tokens:
            return float(max_tokens)
        return value

    # -- persistence ----------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "format": MODEL_FORMAT,
            "version": MODEL_VERSION,
            "observations": self.observations,
            "params": {
                "prior_weight": self.params.prior_weight, "ridge": self.params.ridge,
                "max_weight": self.params.max_weight, "max_keys": self.params.max_keys,
            },
            "global": self.global_stats.as_list(),
            # JSON keys are strings; hashes may be negative or above 2**53, so keep them exact as text.
            "keys": {str(k): v.as_list() for k, v in self.keys.items()},
        }

    def save(self, path: Path) -> None:
        """Replace ``path`` with the model, atomically (:func:`~carbonforge_runtime.files.write_atomic`)."""
        from carbonforge_runtime.files import write_text_atomic

        write_text_atomic(path, json.dumps(self.to_json(), separators=(",", ":")) + "\n")

    @classmethod
    def from_json(cls, data: Any, params: LtrParams | None = None, source: str = "model") -> LtrModel:
        def bad(problem: str) -> UsageError:
            return UsageError(f"{source} is not a ranker model: {problem}",
                              "point scheduler.params.model at a file written by `carbonforge-runtime ltr fit`")

        if not isinstance(data, dict) or data.get("format") != MODEL_FORMAT:
            raise bad(f"'format' is not {MODEL_FORMAT!r}")
        if data.get("version") != MODEL_VERSION:
            raise bad(f"version {data.get('version')!r} is not {MODEL_VERSION}")
        try:
            saved = data.get("params", {})
            if params is None:
                params = LtrParams.from_mapping(saved, where=source)
            model = cls(params=params, observations=int(data.get("observations", 0)))
            model.global_stats = FitStats.from_list(data["global"])
            for key, values in data["keys"].items():
                model.keys[int(key)] = FitStats.from_list(values)
            while len(model.keys) > params.max_keys:
                model.keys.popitem(last=False)
            model._invalidate()
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise bad(str(exc)[:200]) from None
        return model

    @classmethod
    def load(cls, path: Path, params: LtrParams | None = None) -> LtrModel:
        try:
            raw = files.read_regular(path, MAX_MODEL_BYTES)
            if len(raw) > MAX_MODEL_BYTES:
                raise UsageError(f"ranker model {path} is over {MAX_MODEL_BYTES >> 20} MiB, too large for a model",
                                 "point scheduler.params.model at a file written by `carbonforge-runtime ltr fit`")
            text = raw.decode("utf-8")
        except files.NotRegularFile as exc:
            raise UsageError(f"ranker model {exc}", files.NOT_REGULAR_REMEDY) from None
        except OSError as exc:
            raise UsageError(f"cannot read ranker model {path} ({exc.strerror})",
                             "check scheduler.params.model: it must name a readable file") from None
        except UnicodeDecodeError:
            raise UsageError(f"ranker model {path} is not text (binary or compressed data)",
                             "write it with `carbonforge-runtime ltr fit`") from None
        try:
            data = json.loads(text)
        except RecursionError:
            raise UsageError(f"ranker model {path} is nested too deeply to be a model",
                             "write it with `carbonforge-runtime ltr fit`") from None
        except ValueError as exc:
            raise UsageError(f"ranker model {path} is not JSON ({exc})",
                             "write it with `carbonforge-runtime ltr fit`") from None
        return cls.from_json(data, params, source=str(path))


def _slope(stats: FitStats, ridge: float) -> float:
    """Ridge slope of a centred one-feature fit."""
    if stats.n <= 1.0:
        return 0.0
    sxx = stats.sxx - stats.sx * stats.sx / stats.n
    sxy = stats.sxy - stats.sx * stats.sy / stats.n
    denom = sxx + ridge
    if denom <= 1e-12:
        return 0.0
    return sxy / denom


# -- evaluation -------------------------------------------------------------------------------------


def kendall_tau_b(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's tau-b (ties counted as neither concordant nor discordant). NaN when undefined."""
    import numpy as np

    x = np.asarray(a, dtype=float)
    y = np.asarray(b, dtype=float)
    if x.shape != y.shape:
        raise ValueError("kendall_tau_b needs two sequences of the same length")
    n = len(x)
    if n < 2:
        return float("nan")
    concordant_minus_discordant = 0.0
    pairs_x = 0.0  # pairs not tied in x
    pairs_y = 0.0
    chunk = max(1, 4_000_000 // n)
    for start in range(0, n - 1, chunk):
        rows = np.arange(start, min(start + chunk, n - 1))
        # Compare row i with every j > i.
        dx = np.sign(x[None, :] - x[rows, None])
        dy = np.sign(y[None, :] - y[rows, None])
        upper = np.arange(n)[None, :] > rows[:, None]
        prod = (dx * dy)[upper]
        concordant_minus_discordant += float(prod.sum())
        pairs_x += float((dx[upper] != 0).sum())
        pairs_y += float((dy[upper] != 0).sum())
    if pairs_x == 0 or pairs_y == 0:
        return float("nan")
    return concordant_minus_discordant / math.sqrt(pairs_x * pairs_y)


@dataclass(frozen=True)
class Example:
    """One completed request as the ranker sees it."""

    prefix_hash: int
    prompt_tokens: int
    output_tokens: int
    max_tokens: int | None = None


def fit(examples: Iterable[Example], params: LtrParams | None = None) -> LtrModel:
    model = LtrModel(params=params or LtrParams())
    for ex in examples:
        model.observe(ex.prefix_hash, ex.prompt_tokens, ex.output_tokens)
    return model


def evaluate(model: LtrModel, examples: Sequence[Example], learn: bool = False) -> float:
    """Kendall tau-b between predicted and actual output length over ``examples``.

    With ``learn`` the model observes each example after predicting it (how it runs online).
    """
    predicted: list[float] = []
    actual: list[float] = []
    for ex in examples:
        predicted.append(model.predict(ex.prefix_hash, ex.prompt_tokens, ex.max_tokens))
        actual.append(float(ex.output_tokens))
        if learn:
            model.observe(ex.prefix_hash, ex.prompt_tokens, ex.output_tokens)
    return kendall_tau_b(predicted, actual)

"""Augmentation of training crops: speed, reverberation, EQ, noise and gain (config `augment.*`).

One `Augmenter` per dataset; a training item goes through it in two calls around the crop:

    augment = Augmenter(cfg.augment, cfg.features, crop_samples)  # in the main process; picklable
    wave = augment.before_crop(load_audio(path, sr), rng)   # speed perturbation
    wave = augment.after_crop(crop_or_pad(wave, n, rng), rng)   # reverb, EQ, noise, gain
    feats = augment.log_mel(read_npy_crop(...), rng)        # features.kind=npy: EQ, gain

Every random choice is drawn from the `numpy.random.Generator` passed in (the dataset seeds one
per item), never from global state, so one generator seed gives bit-identical output in any
worker or process. A disabled Augmenter (`augment.enabled=false`, the default) returns its input
unchanged and draws nothing, so crops stay what they were without augmentation.

Pieces, in the order they run (each with its own probability):
  speed   resampling by a factor from `speed_factors` (0.9 → `resample(orig=9, new=10)`), so tempo
          and pitch change together, as Kaldi's/WeSpeaker's speed perturbation. Runs before the
          crop, so the crop keeps its length. On a clip longer than a crop needs, only a random
          window of crop × factor samples (+ a margin for the filter) is resampled and exactly
          one crop is returned: the cost stays bounded by the crop, not the clip length.
  reverb  a synthetic room impulse response (`room_impulse_response`): unit direct path, a few
          discrete early echoes, and a diffuse tail of white noise decaying by 60 dB in RT60
          seconds, scaled to a random direct-to-reverberant ratio and normalised to unit energy.
  EQ      a random smooth gain curve: `eq_bands` control points log-spaced from 50 Hz to
          Nyquist, each uniform in `eq_gain_db`, interpolated over log-frequency, plus a random
          tilt in dB/octave around 1 kHz — the colouring of another microphone, channel or
          synthesiser. Reverb and EQ are linear filters and share one FFT pass (zero-padded, so
          the convolution is linear, not circular); the output is trimmed to the input length
          (as WeSpeaker's `convolve(audio, rir)[:len(audio)]`) and scaled back to the input's
          RMS level.
  noise   white, pink (1/f) or brown (1/f²) noise, shaped in the frequency domain (nothing
          below 20 Hz, where brown noise would put half its energy, outside the mel range), or a
          random segment of a file under `noise_dir` (tiled from a random offset if shorter than
          the crop), scaled to a random SNR measured over the whole crop. A file is picked
          uniformly, not by duration.
  gain    a random gain in dB.
Finally, a crop whose peak exceeds 1.0 (full scale of the files it came from) is scaled down to
peak 1.0: scaled, not clipped, so no distortion is added. Only a positive gain or loud noise can
get there; the log-mel front end itself would not mind larger values.

For precomputed log-mel features (natural log of mel power, as `audioclf.spectrogram.log_mel`
writes them) `log_mel` applies the same EQ curve, evaluated at the mel bands' centre
frequencies, and the gain, as per-bin offsets (dB · ln(10) / 10). Speed, reverb and noise have
no faithful feature-domain equivalent and are skipped there; SpecAugment stays in the front end.

Library or own code: measured with `benchmarks/augment_cost.py` (one process, one thread, 2 s
crops of 1-2 s clips at 16 kHz; the development machine's 2 cores, shared, best of 15 rounds).
Extra milliseconds per crop over the 0.38 ms of loading and cropping:

    piece                 here    audiomentations 0.43.1
    noise, generated      0.38    AddColorNoise            1.85
    noise, files          0.17    AddBackgroundNoise       0.37
    EQ                    0.72    SevenBandParametricEQ    3.67
    reverb                1.27    RoomSimulator          158    (pyroomacoustics image sources)
    gain                  0.07    Gain                     0.04
    speed                 0.44    (none: TimeStretch / PitchShift change only one of the two)
    all five, p = 1       2.70    → 325 crops/s in one worker (0.12x of no augmentation)
    default probabilities 1.34    → 579 crops/s

  * Reproducibility decides on its own: audiomentations draws from Python's `random` and numpy's
    global state (`random.uniform`, `np.random.normal`), not from a Generator passed in, so an
    item could only be reproduced by re-seeding global state inside the worker per item.
  * pyroomacoustics alone took 37 ms (RT60 0.2 s), 290 ms (0.5 s) and 2 s (0.8 s) per impulse
    response with the reflection order its `inverse_sabine` asks for; capped at order 3 it takes
    3-35 ms but has no reverberant tail left. The synthetic response costs 0.1 ms to make.
So every piece is own code on numpy (FFTs) and torchaudio (the resampler): no new dependency.
Noise samples are uniform rather than Gaussian (3x cheaper to draw; only the spectrum matters,
and every mel band sums many bins).
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch
import torchaudio

from audioclf.config import AugmentConfig, ConfigError, FeaturesConfig
from audioclf.data.readers import load_audio

NOISE_SUFFIXES = (".wav", ".flac", ".ogg")
EQ_LOWEST_HZ = 50.0  # the EQ curve is flat below its first control point
EQ_PIVOT_HZ = 1000.0  # the tilt leaves this frequency unchanged
EQ_PAD = 512  # zero padding for the zero-phase EQ filter: < -50 dB of its energy lies further out
NOISE_LOWEST_HZ = 20.0  # coloured noise has no energy below this (brown would be mostly drift)
NOISE_EXPONENTS = {"white": 0.0, "pink": 1.0, "brown": 2.0}  # power spectrum ∝ 1 / f^exponent
SPEED_MARGIN = 32  # input samples kept on each side of a speed window (resampler filter support)
EARLY_REFLECTIONS_S = (0.002, 0.040)  # window of the discrete early echoes after the direct path
TAIL_ONSET_S = (0.002, 0.010)  # the diffuse tail starts this long after the direct path
DB_TO_LOG_POWER = math.log(10.0) / 10.0  # a power gain of 1 dB in natural-log units


class Augmenter:
    """Random, seeded augmentation of training crops; `enabled` is `cfg.enabled`.

    Picklable: built once in the main process (which also lists and checks `noise_dir`), copied
    into each DataLoader worker; decoded noise files are cached lazily per process.
    """

    def __init__(self, cfg: AugmentConfig, features: FeaturesConfig, crop_samples: int):
        self.cfg = cfg
        self.sample_rate = features.sample_rate
        self.crop_samples = crop_samples
        self.mel_centres_hz = mel_centre_frequencies(features)
        self.mel_eq_basis = eq_basis(self.mel_centres_hz, self.sample_rate, cfg.eq_bands)
        # factor = orig / new with small integers: 0.9 → 9/10 reads 9 samples as 10.
        self.speed_ratios = [
            Fraction(f).limit_denominator(100).as_integer_ratio() for f in cfg.speed_factors
        ]
        self.noise_files = find_noise_files(cfg.noise_dir) if cfg.enabled and cfg.noise_dir else []
        self._init_caches()

    def _init_caches(self) -> None:
        self._noise_cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._noise_cache_bytes = 0
        self._resamplers: dict[tuple[int, int], torchaudio.transforms.Resample] = {}

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for key in ("_noise_cache", "_noise_cache_bytes", "_resamplers"):
            state.pop(key)
        return state  # each process fills its own caches

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_caches()

    @property
    def enabled(self) -> bool:
        return self.cfg.enabled

    # -----------------------------------------------------------------------------------------
    # Waveforms

    def before_crop(self, wave: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
        """Speed-perturb a whole clip (1-D float32): length ≈ len / factor (one crop if long)."""
        if not self.enabled or not _chance(rng, self.cfg.speed_prob):
            return wave
        orig, new = self.speed_ratios[int(rng.integers(len(self.speed_ratios)))]
        if orig == new:
            return wave
        window = math.ceil(self.crop_samples * orig / new) + 2 * SPEED_MARGIN
        if wave.shape[0] <= window:
            return self._resample(wave, orig, new)
        start = int(rng.integers(0, wave.shape[0] - window + 1))
        resampled = self._resample(wave[start : start + window], orig, new)
        skip = SPEED_MARGIN * new // orig  # drop the window edges the filter saw zeros past
        return resampled[skip : skip + self.crop_samples]

    def _resample(self, wave: torch.Tensor, orig: int, new: int) -> torch.Tensor:
        if (orig, new) not in self._resamplers:  # kernels are built once per process
            self._resamplers[orig, new] = torchaudio.transforms.Resample(orig, new)
        with torch.no_grad():
            return self._resamplers[orig, new](wave.float()).contiguous()

    def after_crop(self, wave: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
        """Reverb, EQ, noise and gain on a crop (1-D float32); same length out."""
        if not self.enabled:
            return wave
        if wave.dim() != 1:
            raise ValueError(
                f"Augmenter.after_crop expects a 1-D waveform, got shape {tuple(wave.shape)}"
            )
        cfg = self.cfg
        x = wave.detach().cpu().numpy().astype(np.float32)  # a copy: the input stays untouched
        changed = False
        rir = None
        if _chance(rng, cfg.reverb_prob):
            rir = room_impulse_response(
                rng,
                self.sample_rate,
                rt60=_uniform(rng, cfg.reverb_rt60),
                drr_db=_uniform(rng, cfg.reverb_drr_db),
                early_reflections=cfg.reverb_early_reflections,
                max_length=x.shape[0],
            )
        eq_curve = self._random_eq(rng) if _chance(rng, cfg.eq_prob) else None
        if rir is not None or eq_curve is not None:
            x = self._filter(x, rir, eq_curve)
            changed = True
        if _chance(rng, cfg.noise_prob):
            snr_db = _uniform(rng, cfg.noise_snr_db)
            x = add_noise(x, self._noise(x.shape[0], rng), snr_db)
            changed = True
        if _chance(rng, cfg.gain_prob):
            x *= np.float32(10.0 ** (_uniform(rng, cfg.gain_db) / 20.0))
            changed = True
        if not changed:
            return wave
        peak = float(np.max(np.abs(x))) if x.size else 0.0
        if peak > 1.0:
            x /= np.float32(peak)
        return torch.from_numpy(x)

    def _filter(
        self, x: np.ndarray, rir: np.ndarray | None, eq_curve: np.ndarray | None
    ) -> np.ndarray:
        """Convolve with `rir` and/or apply the EQ curve in one FFT pass; same length and RMS."""
        padding = rir.shape[0] - 1 if rir is not None else 0  # linear, not circular, convolution
        padding += EQ_PAD if eq_curve is not None else 0
        size = fft_length(x.shape[0] + padding)
        spectrum = np.fft.rfft(x, size)
        if rir is not None:
            spectrum *= np.fft.rfft(rir, size)
        if eq_curve is not None:  # dB → amplitude gain: exp(dB · ln(10) / 20)
            basis = _eq_basis_rfft(size, self.sample_rate, self.cfg.eq_bands)
            spectrum *= np.exp(_curve_db(eq_curve, basis) * np.float32(DB_TO_LOG_POWER / 2.0))
        y = np.fft.irfft(spectrum, size)[: x.shape[0]]
        return match_level(y, x)

    def _noise(self, length: int, rng: np.random.Generator) -> np.ndarray:
        if self.noise_files and _chance(rng, self.cfg.noise_file_prob):
            path = self.noise_files[int(rng.integers(len(self.noise_files)))]
            return segment(self._noise_source(path), length, rng)
        color = self.cfg.noise_colors[int(rng.integers(len(self.cfg.noise_colors)))]
        return colored_noise(color, length, self.sample_rate, rng)

    def _noise_source(self, path: str) -> np.ndarray:
        """A decoded noise file, from this process's LRU cache (`noise_cache_mb`)."""
        if path in self._noise_cache:
            self._noise_cache.move_to_end(path)
            return self._noise_cache[path]
        try:
            source = load_audio(path, self.sample_rate).numpy()
        except ValueError as exc:  # AudioReadError: undecodable or empty
            raise ConfigError(
                f"config key augment.noise_dir={self.cfg.noise_dir!r}: noise file {path} cannot "
                f"be used ({exc}); remove or fix the file"
            ) from exc
        budget = self.cfg.noise_cache_mb * 2**20
        if source.nbytes <= budget:
            self._noise_cache[path] = source
            self._noise_cache_bytes += source.nbytes
            while self._noise_cache_bytes > budget:
                _, dropped = self._noise_cache.popitem(last=False)
                self._noise_cache_bytes -= dropped.nbytes
        return source

    # -----------------------------------------------------------------------------------------
    # EQ curve (shared by waveforms and log-mel features)

    def _random_eq(self, rng: np.random.Generator) -> np.ndarray:
        """One random EQ curve as float32 coefficients of `eq_basis`: control-point gains, tilt."""
        gains = rng.uniform(*self.cfg.eq_gain_db, size=self.cfg.eq_bands)
        return np.append(gains, _uniform(rng, self.cfg.eq_tilt_db_per_octave)).astype(np.float32)

    # -----------------------------------------------------------------------------------------
    # Precomputed log-mel features

    def log_mel(self, feats: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """EQ and gain of log-mel features [frames, n_mels] as per-bin log offsets; same shape."""
        if not self.enabled:
            return feats
        if feats.ndim != 2 or feats.shape[1] != self.mel_centres_hz.shape[0]:
            raise ValueError(
                f"Augmenter.log_mel expects features [frames, {self.mel_centres_hz.shape[0]}] "
                f"(features.n_mels), got shape {feats.shape}"
            )
        offset_db = np.zeros(feats.shape[1])
        changed = False
        if _chance(rng, self.cfg.eq_prob):
            offset_db += _curve_db(self._random_eq(rng), self.mel_eq_basis)
            changed = True
        if _chance(rng, self.cfg.gain_prob):
            offset_db += _uniform(rng, self.cfg.gain_db)
            changed = True
        if not changed:
            return feats
        return feats + (offset_db * DB_TO_LOG_POWER).astype(feats.dtype)


# ---------------------------------------------------------------------------------------------
# Building blocks (pure functions of their inputs and the generator)


def _chance(rng: np.random.Generator, probability: float) -> bool:
    return probability > 0.0 and rng.random() < probability


def _uniform(rng: np.random.Generator, low_high: tuple[float, float]) -> float:
    return float(rng.uniform(low_high[0], low_high[1]))


def _power(x: np.ndarray) -> float:
    """Mean square. einsum, not BLAS: no thread pool in the workers, and the same bits for any
    thread setting of the process (float32 partial sums, ~1e-7 relative error)."""
    return float(np.einsum("i,i->", x, x)) / max(1, x.shape[0])


def _zero_mean_uniform(rng: np.random.Generator, length: int) -> np.ndarray:
    """float32 noise uniform in [-0.5, 0.5). Drawing it is ~3x cheaper than Gaussian noise, and
    only its flat spectrum matters: each mel band sums many bins, which makes it Gaussian."""
    return rng.random(length, dtype=np.float32) - np.float32(0.5)


def fft_length(n: int) -> int:
    """Smallest c · 2^k >= n with c in (8, 10, 12, 15): fast for pocketfft, and only four
    lengths per octave, so the per-length tables (EQ basis) stay cached."""
    k = max(0, n.bit_length() - 5)
    while True:
        for c in (8, 10, 12, 15):
            if c << k >= n:
                return c << k
        k += 1


def match_level(y: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """`y` scaled to the RMS level of `reference` (unchanged if either is silent)."""
    power_y, power_ref = _power(y), _power(reference)
    if power_y == 0.0 or power_ref == 0.0:
        return y
    return y * np.float32(math.sqrt(power_ref / power_y))


def add_noise(x: np.ndarray, noise: np.ndarray, snr_db: float) -> np.ndarray:
    """x + noise scaled so that power(x) / power(noise) is `snr_db` over the whole crop.

    A silent crop or silent noise segment is returned unchanged (no SNR is defined).
    """
    power_x, power_noise = _power(x), _power(noise)
    if power_x == 0.0 or power_noise == 0.0:
        return x
    scale = math.sqrt(power_x / (power_noise * 10.0 ** (snr_db / 10.0)))
    return x + noise * np.float32(scale)


def colored_noise(
    color: str, length: int, sample_rate: int, rng: np.random.Generator
) -> np.ndarray:
    """float32 noise of `length` samples, power spectrum ∝ 1/f^k (white 0, pink 1, brown 2)."""
    exponent = NOISE_EXPONENTS[color]
    if exponent == 0.0:
        return _zero_mean_uniform(rng, length)
    spectrum = _zero_mean_uniform(rng, 2 * (length // 2 + 1)).view(np.complex64)  # white, complex
    spectrum *= _noise_amplitudes(exponent, length, sample_rate)
    return np.fft.irfft(spectrum, length)


@functools.lru_cache(maxsize=16)
def _noise_amplitudes(exponent: float, length: int, sample_rate: int) -> np.ndarray:
    """Amplitude f^(-exponent/2) of each rfft bin; zero below NOISE_LOWEST_HZ (and at DC)."""
    hz = np.fft.rfftfreq(length, 1.0 / sample_rate)
    amplitudes = np.maximum(hz, NOISE_LOWEST_HZ) ** (-exponent / 2.0)
    amplitudes[hz < NOISE_LOWEST_HZ] = 0.0
    return amplitudes.astype(np.float32)


def eq_basis(freqs_hz: np.ndarray, sample_rate: int, bands: int) -> np.ndarray:
    """[bands + 1, len(freqs_hz)] float32: an EQ curve in dB is `coefficients @ eq_basis`.

    Rows 0..bands-1 interpolate the control-point gains linearly over log-frequency (control
    points log-spaced from EQ_LOWEST_HZ to Nyquist, flat below); the last row is the tilt, in
    octaves from EQ_PIVOT_HZ (so the tilt coefficient is in dB per octave). Waveforms (FFT bins)
    and log-mel features (mel band centres) share it: one draw is the same curve in both.
    """
    octaves = np.log2(np.maximum(np.asarray(freqs_hz, dtype=np.float64), EQ_LOWEST_HZ))
    controls = np.linspace(math.log2(EQ_LOWEST_HZ), math.log2(sample_rate / 2), bands)
    rows = [np.interp(octaves, controls, unit) for unit in np.eye(bands)]
    return np.stack([*rows, octaves - math.log2(EQ_PIVOT_HZ)]).astype(np.float32)


def _curve_db(coefficients: np.ndarray, basis: np.ndarray) -> np.ndarray:
    return np.einsum("k,kf->f", coefficients, basis)  # as _power: einsum, not BLAS


@functools.lru_cache(maxsize=16)
def _eq_basis_rfft(size: int, sample_rate: int, bands: int) -> np.ndarray:
    return eq_basis(np.fft.rfftfreq(size, 1.0 / sample_rate), sample_rate, bands)


def segment(source: np.ndarray, length: int, rng: np.random.Generator) -> np.ndarray:
    """A random `length`-sample window of `source`, tiled from a random offset if it is shorter."""
    if source.shape[0] >= length:
        start = int(rng.integers(0, source.shape[0] - length + 1))
        return source[start : start + length]
    offset = int(rng.integers(source.shape[0]))
    copies = -(-(offset + length) // source.shape[0])
    return np.tile(source, copies)[offset : offset + length]


def room_impulse_response(
    rng: np.random.Generator,
    sample_rate: int,
    rt60: float,
    drr_db: float,
    early_reflections: int,
    max_length: int | None = None,
) -> np.ndarray:
    """A synthetic room impulse response, float32 with unit energy, direct path at sample 0.

    Diffuse tail: white noise under an exponential envelope that falls by 60 dB in `rt60`
    seconds, starting 2-10 ms after the direct path. Early reflections: `early_reflections`
    taps of random sign 2-40 ms after the direct path, 2-6 times the tail's envelope there.
    Tail and reflections together are scaled so that direct / reverberant energy is `drr_db`.
    The response is `rt60` seconds long, or `max_length` samples if shorter (a longer one would
    only add to what is trimmed off after the convolution).
    """
    length = max(2, int(round(rt60 * sample_rate)))
    if max_length is not None:
        length = max(2, min(length, max_length))
    decay = 3.0 * math.log(10.0) / (rt60 * sample_rate)  # amplitude: 10^-3 (= -60 dB) at rt60
    # The tail's RMS at each sample (sqrt(12): unit variance of the zero-mean uniform noise).
    envelope = np.float32(math.sqrt(12.0)) * np.exp(-decay * np.arange(length, dtype=np.float32))
    reverberant = _zero_mean_uniform(rng, length) * envelope
    onset = max(1, int(round(_uniform(rng, TAIL_ONSET_S) * sample_rate)))
    reverberant[:onset] = 0.0
    if early_reflections:
        delays = rng.uniform(*EARLY_REFLECTIONS_S, size=early_reflections) * sample_rate
        delays = np.clip(np.round(delays).astype(np.int64), 1, length - 1)
        signs = np.where(rng.random(early_reflections) < 0.5, -1.0, 1.0)
        amplitudes = rng.uniform(2.0, 6.0, size=early_reflections) * signs
        np.add.at(reverberant, delays, (amplitudes * envelope[delays]).astype(np.float32))
    energy = _power(reverberant) * length
    if energy > 0.0:
        reverberant *= np.float32(math.sqrt(10.0 ** (-drr_db / 10.0) / energy))
    reverberant[0] = 1.0  # the direct path
    return reverberant / np.float32(math.sqrt(_power(reverberant) * length))


def mel_centre_frequencies(features: FeaturesConfig) -> np.ndarray:
    """Centre frequency in Hz of each mel band of the front end (HTK mel scale, as torchaudio)."""
    f_max = features.f_max if features.f_max is not None else features.sample_rate / 2
    low, high = 2595.0 * np.log10(1.0 + np.array([features.f_min, f_max]) / 700.0)
    mels = np.linspace(low, high, features.n_mels + 2)[1:-1]
    return 700.0 * (10.0 ** (mels / 2595.0) - 1.0)


def find_noise_files(folder: str | Path) -> list[str]:
    """Audio files under `folder` (recursive, sorted): the recordings of `augment.noise_dir`."""
    root = Path(folder)
    if not root.is_dir():
        raise ConfigError(
            f"config key augment.noise_dir={str(folder)!r}: folder {root} does not exist; point it "
            'at a folder of noise recordings, or set augment.noise_dir="" for generated noise'
        )
    files = sorted(
        str(p) for p in root.rglob("*") if p.suffix.lower() in NOISE_SUFFIXES and p.is_file()
    )
    if not files:
        raise ConfigError(
            f"config key augment.noise_dir={str(folder)!r}: folder {root} holds no "
            f"{', '.join(NOISE_SUFFIXES)} files (searched recursively); add noise recordings, or "
            'set augment.noise_dir="" for generated noise only'
        )
    return files

"""Augmentation of training crops (config `augment.*`): the source, the room and the channel.

One `Augmenter` per dataset; a training item goes through it in two calls around the crop:

    augment = Augmenter(cfg.augment, cfg.features, crop_samples)  # in the main process; picklable
    wave = augment.before_crop(load_audio(path, sr), rng)   # speed, pitch, stretch
    wave = augment.after_crop(crop_or_pad(wave, n, rng), rng)   # reverb, EQ, noise, gain, band, codec
    feats = augment.log_mel(read_npy_crop(...), crop_seed)  # features.kind=npy: EQ, gain

`before_crop(..., crop_samples=n)` asks for another crop length than the constructor's (longer
crops in the last epochs). Every random choice on a waveform is drawn from the
`numpy.random.Generator` passed in (the dataset seeds one per item), and a log-mel crop's from
its crop seed (`log_mel_offsets`, a whole batch of crops in one numpy pass), never from global
state, so one seed gives bit-identical output in any worker or process. A disabled Augmenter
(`augment.enabled=false`, the default) returns its input unchanged and draws nothing, so crops
stay what they were without augmentation; so does a piece whose probability is 0 (pitch,
stretch, band and codec are 0 by default), so turning one on leaves the others' draws as they
were.

Pieces, in the order they run (each with its own probability; modules beside this one):
  speed, pitch, stretch  before the crop (`pitch.py`): the source's tempo and pitch.
  reverb                 a synthetic room impulse response (`room.py`).
  EQ                     a random smooth gain curve (`channel.py`).
  impulse response       a measured response from `ir_dir` (`responses.py`), mixed wet/dry.
                         Reverb, EQ and the measured response are linear
                         filters and share one zero-padded FFT pass (linear, not circular, so
                         trimmed to the input length as WeSpeaker's `convolve(audio, rir)
                         [:len(audio)]`), then scaled back to the input's RMS level.
  noise                  generated or recorded noise at a random SNR (`noise.py`).
  gain                   a random gain in dB.
  band                   a telephone-like band-pass (`channel.py`): after the noise, so a
                         band-limited crop has band-limited noise, as behind a real channel.
  codec                  a resample, mu-law or quantiser round trip (`channel.py`), last: a
                         codec sees what the channel delivers.
Finally, a crop whose peak exceeds 1.0 (full scale of the files it came from) is scaled down to
peak 1.0: scaled, not clipped, so no distortion is added.

For precomputed log-mel features (natural log of mel power, as `audioclf.spectrogram.log_mel`
writes them) `log_mel` applies the same EQ curve, evaluated at the mel bands' centre
frequencies, and the gain, as per-bin offsets (dB · ln(10) / 10): the same distributions as on
a waveform, from the crop seed's own draws. The other pieces are skipped there; SpecAugment,
spectral tilt and mel-axis warp stay in the front end.

Every piece is own code on numpy and torch / torchaudio: the libraries draw from global random
state (an item could not be reproduced from its generator) and were slower where measured
(benchmarks/augment_cost.py; the table in benchmarks/RESULTS.md, "Augmentation: own code or a
library").
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from audioclf.config import AugmentConfig, ConfigError, FeaturesConfig
from audioclf.data.augment.channel import (
    EQ_PAD,
    band_limit,
    codec_ratio,
    curve_db,
    eq_basis,
    eq_basis_rfft,
    mel_centre_frequencies,
    mulaw_round_trip,
    quantize_round_trip,
    resample_round_trip,
)
from audioclf.data.augment.common import (
    chance,
    fft_length,
    match_level,
    uniform,
)
from audioclf.data.augment.noise import add_noise, colored_noise, find_noise_files, segment
from audioclf.data.augment.pitch import (
    PITCH_DENOMINATOR,
    ratio_of,
    shift_and_stretch,
    speed_perturb,
    stft_size,
)
from audioclf.data.augment.responses import load_impulse_responses, wet_dry_kernel
from audioclf.data.augment.room import room_impulse_response
from audioclf.data.readers import load_audio, seeded_uniforms
from audioclf.spectrogram import DB_TO_LOG_POWER

__all__ = [
    "Augmenter",
    "room_impulse_response",
]


class Augmenter:
    """Random, seeded augmentation of training crops; `enabled` is `cfg.enabled`.

    Picklable: built once in the main process (which also lists and checks `noise_dir` and
    reads `ir_dir`'s responses), copied
    into each DataLoader worker; decoded noise files are cached lazily per process.
    """

    def __init__(self, cfg: AugmentConfig, features: FeaturesConfig, crop_samples: int):
        self.cfg = cfg
        self.sample_rate = features.sample_rate
        self.crop_samples = crop_samples
        self.mel_centres_hz = mel_centre_frequencies(features)
        self.mel_eq_basis = eq_basis(self.mel_centres_hz, self.sample_rate, cfg.eq_bands)
        # EQ coefficients' ranges: each control point's gain, then the tilt
        ranges = np.array([cfg.eq_gain_db] * cfg.eq_bands + [cfg.eq_tilt_db_per_octave])
        self._eq_low, self._eq_span = ranges[:, 0], ranges[:, 1] - ranges[:, 0]
        self.speed_ratios = [ratio_of(f, 100) for f in cfg.speed_factors]
        self.stft_size = stft_size(self.sample_rate)
        if cfg.enabled and cfg.band_prob > 0.0:
            check_band(cfg, self.sample_rate)
        self.noise_files = find_noise_files(cfg.noise_dir) if cfg.enabled and cfg.noise_dir else []
        self.impulse_responses = (
            load_impulse_responses(cfg.ir_dir, self.sample_rate)
            if cfg.enabled and cfg.ir_dir and cfg.ir_prob > 0.0
            else []
        )
        self._init_caches()

    def _init_caches(self) -> None:
        self._noise_cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._noise_cache_bytes = 0

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for key in ("_noise_cache", "_noise_cache_bytes"):
            state.pop(key)
        return state  # each process fills its own cache

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_caches()

    @property
    def enabled(self) -> bool:
        return self.cfg.enabled

    # -----------------------------------------------------------------------------------------
    # Before the crop: the source's tempo and pitch

    def before_crop(
        self, wave: torch.Tensor, rng: np.random.Generator, crop_samples: int | None = None
    ) -> torch.Tensor:
        """Speed, pitch and stretch of a whole clip (1-D float32): length ≈ len / the tempo
        factor, or exactly one crop of `crop_samples` (default: the constructor's) if long."""
        if not self.enabled:
            return wave
        crop = self.crop_samples if crop_samples is None else int(crop_samples)
        if crop < 1:
            raise ValueError(f"Augmenter.before_crop needs crop_samples >= 1, got {crop_samples}")
        speed = self._draw_speed(rng)
        pitch = self._draw_pitch(rng)
        rate = self._draw_stretch(rng)
        if pitch is None and rate is None:  # speed alone: as before pitch and stretch existed
            return wave if speed is None else speed_perturb(wave, *speed, crop, rng)
        return shift_and_stretch(wave, speed, pitch, rate, crop, rng, self.stft_size)

    def _draw_speed(self, rng: np.random.Generator) -> tuple[int, int] | None:
        if not chance(rng, self.cfg.speed_prob):
            return None
        orig, new = self.speed_ratios[int(rng.integers(len(self.speed_ratios)))]
        return None if orig == new else (orig, new)

    def _draw_pitch(self, rng: np.random.Generator) -> tuple[int, int] | None:
        if not chance(rng, self.cfg.pitch_prob):
            return None
        ratio = ratio_of(2.0 ** (uniform(rng, self.cfg.pitch_semitones) / 12.0), PITCH_DENOMINATOR)
        return None if ratio[0] == ratio[1] else ratio

    def _draw_stretch(self, rng: np.random.Generator) -> float | None:
        if not chance(rng, self.cfg.stretch_prob):
            return None
        rate = uniform(rng, self.cfg.stretch_factors)
        return None if rate == 1.0 else rate

    # -----------------------------------------------------------------------------------------
    # After the crop: the room and the channel

    def after_crop(self, wave: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
        """Reverb, EQ, noise, gain, band and codec on a crop (1-D float32); same length out."""
        if not self.enabled:
            return wave
        if wave.dim() != 1:
            raise ValueError(
                f"Augmenter.after_crop expects a 1-D waveform, got shape {tuple(wave.shape)}"
            )
        x = wave.detach().cpu().numpy().astype(np.float32)  # a copy: the input stays untouched
        changed = False
        for piece in (self._room_and_eq, self._add_noise, self._gain, self._band, self._codec):
            out = piece(x, rng)  # None: the piece was not drawn for this crop
            if out is not None:
                x, changed = out, True
        if not changed:
            return wave
        peak = float(np.max(np.abs(x))) if x.size else 0.0
        if peak > 1.0:
            x /= np.float32(peak)
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))

    def _room_and_eq(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray | None:
        cfg, kernels = self.cfg, []
        if chance(rng, cfg.reverb_prob):
            kernels.append(
                room_impulse_response(
                    rng,
                    self.sample_rate,
                    rt60=uniform(rng, cfg.reverb_rt60),
                    drr_db=uniform(rng, cfg.reverb_drr_db),
                    early_reflections=cfg.reverb_early_reflections,
                    max_length=x.shape[0],
                )
            )
        eq_curve = self._random_eq(rng) if chance(rng, cfg.eq_prob) else None
        # Drawn last and only with responses: without ir_dir the draws above are unchanged.
        if self.impulse_responses and chance(rng, cfg.ir_prob):
            response = self.impulse_responses[int(rng.integers(len(self.impulse_responses)))]
            kernels.append(wet_dry_kernel(response[: x.shape[0]], uniform(rng, cfg.ir_wet)))
        if not kernels and eq_curve is None:
            return None
        return self._filter(x, kernels, eq_curve)

    def _filter(
        self, x: np.ndarray, kernels: list[np.ndarray], eq_curve: np.ndarray | None
    ) -> np.ndarray:
        """Convolve with each of `kernels` (room responses) and/or apply the EQ curve in one
        FFT pass; same length and RMS."""
        padding = sum(k.shape[0] - 1 for k in kernels)  # linear, not circular, convolution
        padding += EQ_PAD if eq_curve is not None else 0
        size = fft_length(x.shape[0] + padding)
        spectrum = np.fft.rfft(x, size)
        for kernel in kernels:
            spectrum *= np.fft.rfft(kernel, size)
        if eq_curve is not None:  # dB → amplitude gain: exp(dB · ln(10) / 20)
            basis = eq_basis_rfft(size, self.sample_rate, self.cfg.eq_bands)
            spectrum *= np.exp(curve_db(eq_curve, basis) * np.float32(DB_TO_LOG_POWER / 2.0))
        y = np.fft.irfft(spectrum, size)[: x.shape[0]]
        return match_level(y, x)

    def _add_noise(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray | None:
        if not chance(rng, self.cfg.noise_prob):
            return None
        snr_db = uniform(rng, self.cfg.noise_snr_db)
        return add_noise(x, self._noise(x.shape[0], rng), snr_db)

    def _gain(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray | None:
        if not chance(rng, self.cfg.gain_prob):
            return None
        return x * np.float32(10.0 ** (uniform(rng, self.cfg.gain_db) / 20.0))

    def _band(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray | None:
        if not chance(rng, self.cfg.band_prob):
            return None
        low_hz = uniform(rng, self.cfg.band_low_hz)
        high_hz = min(uniform(rng, self.cfg.band_high_hz), self.sample_rate / 2)
        return band_limit(x, self.sample_rate, low_hz, high_hz)

    def _codec(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray | None:
        cfg = self.cfg
        if not chance(rng, cfg.codec_prob):
            return None
        kind = cfg.codec_kinds[int(rng.integers(len(cfg.codec_kinds)))]
        if kind == "mulaw":
            return mulaw_round_trip(x)
        if kind == "quantize":
            return quantize_round_trip(
                x, int(rng.integers(cfg.codec_bits[0], cfg.codec_bits[1] + 1))
            )
        ratio = codec_ratio(uniform(rng, cfg.codec_rates), self.sample_rate)
        return resample_round_trip(x, ratio) if 0 < ratio < 1 else None  # nothing above to cut

    def _noise(self, length: int, rng: np.random.Generator) -> np.ndarray:
        if self.noise_files and chance(rng, self.cfg.noise_file_prob):
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

    def _random_eq(self, rng: np.random.Generator) -> np.ndarray:
        """One random EQ curve as float32 coefficients of `eq_basis`: control-point gains, tilt."""
        return self._eq_coefficients(rng.random(self.cfg.eq_bands + 1))

    def _eq_coefficients(self, u: np.ndarray) -> np.ndarray:
        """float32 EQ coefficients [..., eq_bands + 1] (control-point gains, tilt) from uniforms
        in [0, 1) of that shape: low + (high - low) · u, Generator.uniform's own arithmetic."""
        return (self._eq_low + self._eq_span * u).astype(np.float32)

    # -----------------------------------------------------------------------------------------
    # Precomputed log-mel features

    def log_mel(self, feats: np.ndarray, seed: int) -> np.ndarray:
        """EQ and gain of log-mel features [frames, n_mels] as per-bin log offsets, drawn from
        the crop's seed (`log_mel_offsets`); same shape."""
        if not self.enabled:
            return feats
        if feats.ndim != 2 or feats.shape[1] != self.mel_centres_hz.shape[0]:
            raise ValueError(
                f"Augmenter.log_mel expects features [frames, {self.mel_centres_hz.shape[0]}] "
                f"(features.n_mels), got shape {feats.shape}"
            )
        offsets = self.log_mel_offsets([seed])
        return feats if offsets is None else feats + offsets[0].astype(feats.dtype, copy=False)

    def log_mel_offsets(self, seeds) -> np.ndarray | None:
        """The per-bin log offsets (float32 [len(seeds), n_mels]) that `log_mel` adds to the
        crops of these crop seeds, or None when none of them gets any (a crop without EQ or
        gain has a row of zeros); a batch reader adds them later, on the device.

        Each crop's EQ and gain are drawn from its seed (`seeded_uniforms`: chance of EQ, the
        curve's coefficients, chance of gain, gain), in one numpy pass for a whole batch, with
        the same arithmetic row by row for one seed or many: the per-file and the packed
        readers give a crop the same offsets to the bit."""
        if not self.enabled:
            return None
        cfg, bands = self.cfg, self.cfg.eq_bands
        u = seeded_uniforms(seeds, bands + 4, _LOG_MEL_STREAM)
        eq, gain = u[:, 0] < cfg.eq_prob, u[:, bands + 2] < cfg.gain_prob
        any_eq, any_gain = bool(eq.any()), bool(gain.any())
        if not (any_eq or any_gain):
            return None
        offset_db = np.zeros((len(u), self.mel_eq_basis.shape[1]), dtype=np.float32)
        if any_eq:  # float32 products summed in order, row by row: the same bits for any batch
            coefficients = self._eq_coefficients(u[:, 1 : bands + 2])
            curve = np.add.reduce(coefficients[:, :, None] * self.mel_eq_basis, axis=1)
            offset_db += np.where(eq[:, None], curve, np.float32(0))
        if any_gain:
            low, high = cfg.gain_db
            gain_db = np.where(gain, low + (high - low) * u[:, bands + 3], 0.0)
            offset_db += gain_db.astype(np.float32)[:, None]
        return offset_db * np.float32(DB_TO_LOG_POWER)


_LOG_MEL_STREAM = 0x6C6F_675F_6D65_6C  # seeded_uniforms' stream of log_mel_offsets ("log_mel")


def check_band(cfg: AugmentConfig, sample_rate: int) -> None:
    """Every drawn low cut-off lies below every drawn high one, and below Nyquist."""
    nyquist = sample_rate / 2
    if cfg.band_low_hz[1] >= min(cfg.band_high_hz[0], nyquist):
        raise ConfigError(
            f"config key augment.band_low_hz={list(cfg.band_low_hz)}: its top must lie below "
            f"augment.band_high_hz's bottom ({cfg.band_high_hz[0]:g} Hz) and below "
            f"sample_rate / 2 ({nyquist:g} Hz); lower it or raise band_high_hz"
        )

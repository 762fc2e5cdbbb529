"""Config sections of the input side: the index sheet, batches, features, clips, augmentation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from audioclf.config.base import check as _check


@dataclass
class DataConfig:
    index: str = "data/demo/index.xlsx"  # index sheet: .xlsx, .csv or .parquet
    root: str = ""  # folder that relative paths are resolved against; "" = the index's folder
    sheet: int | str = 0  # Excel sheet name or position
    header_row: int | None = None  # sheet row (1-based) holding the column names; null = the first of the first 20 rows that holds the class, item and id columns
    class_column: str = "a_cls"  # column holding the class label
    item_column: str = "a_item"  # column holding the source/recording inside a class
    id_column: str = "a_id"  # column holding the unique sample id
    path_column: str = "path"  # column holding each sample's file path (used when present)
    path_template: str = ""  # e.g. "features/{a_id}.npy"; used when the path column is absent
    split_column: str = "split"  # optional column with train/val/test per row
    check_files: bool = True  # fail early when referenced files do not exist
    cache: bool = True  # cache the validated index next to it (parsed once, re-read in ms)
    cache_dir: str = ""  # "" = <index folder>/.audioclf_cache
    val_ratio: float = 0.2  # share of classes (or items) held out when no split column
    holdout: Literal["classes", "items"] = "classes"  # open-set (whole classes) or closed-set split
    seed: int = 0  # seed of the generated split
    skip_bad_files: bool = False  # skip unreadable files (counted, reported) instead of failing
    num_workers: int = 2  # DataLoader worker processes per rank
    pin_memory: bool = True  # pin host memory (only takes effect on CUDA)
    persistent_workers: bool = True  # keep workers alive between epochs
    prefetch_factor: int = 2  # units (of pack_read_batches training batches) prefetched per worker
    unlabelled: str = ""  # unlabelled audio of the source you deploy to, learnt from beside the labelled sheet: a folder (searched recursively) or a sheet with a path column (and optional split: empty or train rows used); the unlabelled.* keys say how; "" = none (docs/training.md, "Audio from where you deploy")
    pack_read_batches: int = 1  # training batches a worker reads in one go (one unit, in one shared buffer); from a feature pack its reads are sorted by file and offset: more for slow storage (docs/data.md, "Large datasets")

    def __post_init__(self) -> None:
        _check(self.header_row is None or self.header_row >= 1, "data.header_row",
               self.header_row, "a row number >= 1, or null to find the header row")
        _check(0.0 <= self.val_ratio < 1.0, "data.val_ratio", self.val_ratio, "a number in [0, 1)")
        _check(self.num_workers >= 0, "data.num_workers", self.num_workers, "0 or more")
        _check(self.prefetch_factor >= 1, "data.prefetch_factor", self.prefetch_factor, ">= 1")
        _check(self.pack_read_batches >= 1, "data.pack_read_batches", self.pack_read_batches,
               ">= 1")


@dataclass
class SamplerConfig:
    batch_size: int = 32  # samples per batch on each rank
    m: int = 4  # items per class in a batch (one id per item); batch_size / m classes per batch
    split: Literal["classes", "batches"] = "classes"  # divide classes or batches between ranks
    small_classes: Literal["replace", "skip"] = "replace"  # classes with < m items: repeat items or drop

    def __post_init__(self) -> None:
        _check(self.m >= 2, "sampler.m", self.m, ">= 2 (triplet loss needs positives)")
        _check(
            self.batch_size % self.m == 0,
            "sampler.batch_size",
            self.batch_size,
            f"a multiple of sampler.m={self.m}",
        )


@dataclass
class FeaturesConfig:
    """How audio becomes the model's log-mel input: the settings the model's tensors depend on
    (with `model`, what a checkpoint's architecture is; resume and export compare these)."""

    kind: Literal["audio", "npy"] = "audio"  # raw audio files or precomputed log-mel .npy files
    sample_rate: int = 16000  # audio is resampled to this rate
    n_fft: int = 512  # FFT size of the log-mel front end
    win_length: int = 400  # window length in samples
    hop_length: int = 160  # hop in samples (one feature frame)
    n_mels: int = 64  # mel bins (= bins of precomputed features)
    f_min: float = 20.0  # lowest mel frequency in Hz
    f_max: float | None = None  # highest mel frequency; None = sample_rate / 2
    norm: Literal["utterance", "utterance_bin", "none"] = "utterance"  # per-utterance mean/var over all bins, per bin (CMVN), or none

    def __post_init__(self) -> None:
        _check(self.sample_rate > 0, "features.sample_rate", self.sample_rate, "> 0")
        _check(self.hop_length > 0, "features.hop_length", self.hop_length, "> 0")
        _check(self.n_mels > 0, "features.n_mels", self.n_mels, "> 0")

    def samples(self, seconds: float) -> int:
        """Samples in `seconds` of audio at features.sample_rate."""
        return int(round(seconds * self.sample_rate))

    def frames(self, samples: int) -> int:
        """Centred log-mel frames of a clip of `samples` samples (torchaudio's center=True)."""
        return max(1, samples // self.hop_length + 1)


@dataclass
class ClipsConfig:
    """Which part of each file is read: training crops and evaluation clips."""

    crop_seconds: float = 2.0  # training crop length
    pad_mode: Literal["repeat", "zeros"] = "repeat"  # how clips shorter than the crop are filled
    eval_crop: Literal["full", "center"] = "full"  # evaluation: whole clip or a centred crop
    eval_max_seconds: float = 30.0  # evaluation clips are cut (centred) to at most this length
    npy_layout: Literal["frames_bins", "bins_frames"] = "frames_bins"  # axis order of .npy files
    final_crop_seconds: float | None = None  # training crop length in the last train.final_epochs epochs (large-margin fine-tuning); null = crop_seconds

    def __post_init__(self) -> None:
        _check(self.crop_seconds > 0, "clips.crop_seconds", self.crop_seconds, "> 0")
        _check(self.final_crop_seconds is None or self.final_crop_seconds > 0,
               "clips.final_crop_seconds", self.final_crop_seconds, "> 0, or null")
        _check(self.eval_max_seconds > 0, "clips.eval_max_seconds", self.eval_max_seconds, "> 0")

    def crop_samples(self, features: FeaturesConfig) -> int:
        return features.samples(self.crop_seconds)

    def eval_max_frames(self, features: FeaturesConfig) -> int:
        """Longest evaluation clip of precomputed features, in frames."""
        return features.frames(features.samples(self.eval_max_seconds))


@dataclass
class SpecAugmentConfig:
    enabled: bool = True  # SpecAugment masks in the front end, training mode only
    freq_mask: int = 8  # widest frequency mask in bins
    time_mask: int = 20  # widest time mask in frames
    num_masks: int = 2  # masks of each kind per example
    tilt_db: float = 0.0  # per-crop random spectral tilt on the log-mel, before the normalisation: up to ± this many dB between the lowest and highest mel bin (training only; 0 = off; not switched by enabled; no effect with features.norm=utterance_bin)
    freq_warp: float = 0.0  # per-crop random warp of the mel axis by a factor in [1 - w, 1 + w], before the normalisation: a peak at bin p moves to p · factor (filterbank jitter; training only; 0 = off; not switched by enabled)

    def __post_init__(self) -> None:
        for key in ("freq_mask", "time_mask", "num_masks"):
            _check(getattr(self, key) >= 0, f"spec_augment.{key}", getattr(self, key), ">= 0")
        _check(0.0 <= self.tilt_db <= 40.0, "spec_augment.tilt_db", self.tilt_db, "in [0, 40]")
        _check(0.0 <= self.freq_warp < 0.5, "spec_augment.freq_warp", self.freq_warp, "in [0, 0.5)")


@dataclass
class AugmentConfig:
    enabled: bool = False  # augment training crops: waveforms, or log-mel for features.kind=npy (EQ and gain only)
    speed_prob: float = 1.0  # share of clips speed-perturbed before the crop (tempo and pitch together, Kaldi/WeSpeaker style)
    speed_factors: tuple[float, ...] = (0.9, 1.0, 1.1)  # speed drawn uniformly from these; 1.1 = 10 % faster and higher, 1.0 = unchanged
    reverb_prob: float = 0.3  # share of crops convolved with a synthetic room impulse response
    reverb_rt60: tuple[float, float] = (0.2, 0.8)  # reverberation time range in seconds (time to decay by 60 dB)
    reverb_drr_db: tuple[float, float] = (0.0, 12.0)  # direct-to-reverberant energy ratio range in dB (lower = more reverberant)
    reverb_early_reflections: int = 4  # discrete echoes 2-40 ms after the direct sound; 0 = diffuse tail only
    eq_prob: float = 0.5  # share of crops coloured by a random smooth EQ curve (microphone / channel / synthesiser)
    eq_bands: int = 6  # control points of the EQ curve, log-spaced from 50 Hz to sample_rate / 2
    eq_gain_db: tuple[float, float] = (-6.0, 6.0)  # gain range of each control point in dB
    eq_tilt_db_per_octave: tuple[float, float] = (-1.0, 1.0)  # spectral tilt range (dB per octave, pivot 1 kHz), added to the curve
    noise_prob: float = 0.5  # share of crops with added noise
    noise_snr_db: tuple[float, float] = (5.0, 20.0)  # signal-to-noise ratio range in dB
    noise_colors: tuple[Literal["white", "pink", "brown"], ...] = ("white", "pink", "brown")  # generated noise colour, drawn uniformly
    noise_dir: str = ""  # folder of noise recordings (wav/flac/ogg, searched recursively); "" = generated noise only
    noise_file_prob: float = 0.5  # with noise_dir set: share of noisy crops using a random file segment instead of generated noise
    noise_cache_mb: int = 256  # decoded noise files kept per data-loader process (least recently used dropped first)
    gain_prob: float = 0.5  # share of crops with a random gain
    gain_db: tuple[float, float] = (-6.0, 6.0)  # gain range in dB
    pitch_prob: float = 0.0  # share of clips pitch-shifted without a tempo change (before the crop)
    pitch_semitones: tuple[float, float] = (-2.0, 2.0)  # pitch shift range in semitones (each draw snapped to within 0.09 semitones, for small resampling kernels)
    stretch_prob: float = 0.0  # share of clips time-stretched without a pitch change (before the crop)
    stretch_factors: tuple[float, float] = (0.85, 1.15)  # tempo factor range; 1.15 = 15 % faster, same pitch
    band_prob: float = 0.0  # share of crops band-limited (a telephone-like channel)
    band_low_hz: tuple[float, float] = (100.0, 400.0)  # range of the low cut-off in Hz (-3 dB, 24 dB/octave below); its top must lie below band_high_hz's bottom
    band_high_hz: tuple[float, float] = (3000.0, 7000.0)  # range of the high cut-off in Hz (-3 dB, 24 dB/octave above; capped at sample_rate / 2)
    codec_prob: float = 0.0  # share of crops passed through a codec-like round trip
    codec_kinds: tuple[Literal["resample", "mulaw", "quantize"], ...] = ("resample", "mulaw", "quantize")  # drawn uniformly: down- and upsampling, 8-bit mu-law, or coarse quantisation
    codec_rates: tuple[float, float] = (6000.0, 11025.0)  # sample-rate range of the resample round trip in Hz (snapped to a ratio of sample_rate with denominator <= 16; a rate >= sample_rate leaves the crop as it is)
    codec_bits: tuple[int, int] = (6, 10)  # bit-depth range of the quantisation round trip (levels over ± the crop's peak)
    ir_dir: str = ""  # experimental: folder of measured impulse responses (.wav, any rate, searched recursively; read once, resampled, cut at the largest sample and after 2 s): crops convolved with a random one; "" = none; off: impulse responses measured on benchmarks/quality.py, both domains, did not close the other-source gap (RESULTS.md, "Domain generalisation (issue 36)")
    ir_prob: float = 0.5  # experimental: with ir_dir set: share of crops convolved with a measured response (after the synthetic reverb and EQ, in the same FFT pass; RMS level kept) (RESULTS.md, "Domain generalisation (issue 36)")
    ir_wet: tuple[float, float] = (0.5, 1.0)  # experimental: range of the wet share: wet · convolved + (1 - wet) · dry (RESULTS.md, "Domain generalisation (issue 36)")
    freq_mixstyle: float = 0.0  # experimental: share of training crops whose log-mel per-bin mean and std (over time) are mixed with those of a crop of another class in the batch (Freq-MixStyle, in the model's front end; training only; 0 = off; not switched by enabled); off: Freq-MixStyle measured on benchmarks/quality.py, both domains, did not close the other-source gap (RESULTS.md, "Domain generalisation (issue 36)")
    freq_mixstyle_alpha: float = 0.3  # experimental: mixing weight drawn from Beta(alpha, alpha) (small alpha: mostly near 0 or 1) (RESULTS.md, "Domain generalisation (issue 36)")
    mixstyle: float = 0.0  # experimental: share of training crops whose per-channel mean and std are mixed with those of a crop of another class after the first mixstyle_blocks blocks of model.name=cnn or resnet (MixStyle; training only; 0 = off; not switched by enabled); off: MixStyle measured on benchmarks/quality.py, both domains, did not close the other-source gap (RESULTS.md, "Domain generalisation (issue 36)")
    mixstyle_alpha: float = 0.3  # experimental: mixing weight drawn from Beta(alpha, alpha) (RESULTS.md, "Domain generalisation (issue 36)")
    mixstyle_blocks: int = 1  # experimental: MixStyle after each of the first this many blocks (CNN blocks, or ResNet stem + blocks) (RESULTS.md, "Domain generalisation (issue 36)")

    def __post_init__(self) -> None:
        for name in ("speed_prob", "reverb_prob", "eq_prob", "noise_prob", "noise_file_prob", "gain_prob",
                     "pitch_prob", "stretch_prob", "band_prob", "codec_prob", "ir_prob", "freq_mixstyle",
                     "mixstyle"):
            value = getattr(self, name)
            _check(0.0 <= value <= 1.0, f"augment.{name}", value, "a probability in [0, 1]")
        _check(
            len(self.speed_factors) >= 1 and all(0.5 <= f <= 2.0 for f in self.speed_factors),
            "augment.speed_factors", self.speed_factors, "a non-empty list of factors in [0.5, 2.0]",
        )
        self._check_range("reverb_rt60", self.reverb_rt60, 0.01, 5.0)
        self._check_range("reverb_drr_db", self.reverb_drr_db, -30.0, 60.0)
        self._check_range("eq_gain_db", self.eq_gain_db, -30.0, 30.0)
        self._check_range("eq_tilt_db_per_octave", self.eq_tilt_db_per_octave, -6.0, 6.0)
        self._check_range("noise_snr_db", self.noise_snr_db, -30.0, 100.0)
        self._check_range("gain_db", self.gain_db, -60.0, 60.0)
        _check(self.reverb_early_reflections >= 0, "augment.reverb_early_reflections",
               self.reverb_early_reflections, ">= 0")
        _check(self.eq_bands >= 2, "augment.eq_bands", self.eq_bands, ">= 2")
        _check(len(self.noise_colors) >= 1, "augment.noise_colors", self.noise_colors,
               "a non-empty list of 'white', 'pink', 'brown' (for files only, set noise_file_prob=1)")
        _check(self.noise_cache_mb >= 0, "augment.noise_cache_mb", self.noise_cache_mb, ">= 0")
        self._check_range("pitch_semitones", self.pitch_semitones, -12.0, 12.0)
        self._check_range("stretch_factors", self.stretch_factors, 0.5, 2.0)
        self._check_range("band_low_hz", self.band_low_hz, 0.0, 4000.0)
        self._check_range("band_high_hz", self.band_high_hz, 500.0, 48000.0)
        self._check_range("codec_rates", self.codec_rates, 2000.0, 48000.0)
        self._check_range("codec_bits", self.codec_bits, 2, 16)
        self._check_range("ir_wet", self.ir_wet, 0.0, 1.0)
        _check(len(self.codec_kinds) >= 1, "augment.codec_kinds", self.codec_kinds,
               "a non-empty list of 'resample', 'mulaw', 'quantize'")
        for name in ("freq_mixstyle_alpha", "mixstyle_alpha"):
            _check(getattr(self, name) > 0.0, f"augment.{name}", getattr(self, name), "> 0")
        _check(self.mixstyle_blocks >= 1, "augment.mixstyle_blocks", self.mixstyle_blocks, ">= 1")

    @staticmethod
    def _check_range(name: str, value: Any, lowest: float, highest: float) -> None:
        ok = len(value) == 2 and lowest <= value[0] <= value[1] <= highest
        _check(ok, f"augment.{name}", value, f"[low, high] with {lowest} <= low <= high <= {highest}")

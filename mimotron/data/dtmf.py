"""DTMF (telephone keypad) tones and their log-magnitude spectrograms.

A key press is the sum of two sines: one "row" frequency (697/770/852/941 Hz) and one
"column" frequency (1209/1336/1477 Hz). To make the audio encoder learn the tones rather
than memorise waveforms, every tone is randomised (docs/design.md, "The demo task"):
60-120 ms of tone at a random offset inside a 120 ms window at 8 kHz, a random phase per
frequency, amplitude 0.3-1.0, ±1% frequency jitter, and white noise with a standard
deviation of 0.05-0.5.

The spectrogram is a Hann-windowed STFT (``n_fft`` 256, hop 64, centred) whose magnitude
is compressed with ``log1p`` and normalised with fixed constants, so a sample's features
never depend on which other samples share its batch or process.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

SAMPLE_RATE = 8000
WINDOW_S = 0.120
N_FFT = 256
HOP_LENGTH = 64
NUM_FREQ_BINS = N_FFT // 2 + 1  # 129
NUM_FRAMES = 1 + round(SAMPLE_RATE * WINDOW_S) // HOP_LENGTH  # 16 (centred frames)

ROW_HZ: tuple[float, ...] = (697.0, 770.0, 852.0, 941.0)
COLUMN_HZ: tuple[float, ...] = (1209.0, 1336.0, 1477.0)

# Fixed normalisation of log1p(|STFT|): measured once over 4096 random tones of all ten
# digits (mean 1.19, std 0.65) and frozen, so that features never depend on data
# statistics of a run, a batch or a rank.
SPEC_MEAN = 1.2
SPEC_STD = 0.65

_MIN_TONE_S, _MAX_TONE_S = 0.060, 0.120
_MIN_AMPLITUDE, _MAX_AMPLITUDE = 0.3, 1.0
_FREQ_JITTER = 0.01
_MIN_NOISE_STD, _MAX_NOISE_STD = 0.05, 0.5


def dtmf_frequencies(digit: int) -> tuple[float, float]:
    """Row and column frequency (Hz) of a keypad digit.

    The keypad is 1 2 3 / 4 5 6 / 7 8 9 / * 0 #, so ``0`` is 941 Hz + 1336 Hz.

    Args:
        digit: an integer in ``[0, 9]``.

    Returns:
        ``(row_hz, column_hz)``.

    Raises:
        ValueError: ``digit`` is not in ``[0, 9]``.
    """
    if not isinstance(digit, int | np.integer) or not 0 <= digit <= 9:
        raise ValueError(f"digit={digit!r} is invalid: expected an integer in [0, 9]")
    if digit == 0:
        return ROW_HZ[3], COLUMN_HZ[1]
    row, column = divmod(int(digit) - 1, 3)
    return ROW_HZ[row], COLUMN_HZ[column]


def _as_numpy_rng(rng: np.random.Generator | torch.Generator) -> np.random.Generator:
    """A numpy generator driven by ``rng`` (a torch generator seeds a fresh numpy one)."""
    if isinstance(rng, np.random.Generator):
        return rng
    if isinstance(rng, torch.Generator):
        # One draw from the torch stream seeds numpy, so the tone is still a pure
        # function of the torch generator's state.
        seed = int(torch.randint(0, 2**62, (1,), generator=rng).item())
        return np.random.default_rng(seed)
    raise ValueError(
        f"rng={rng!r} is invalid: expected a numpy.random.Generator or a torch.Generator"
    )


def _check_rate(sample_rate: int, window_s: float) -> tuple[int, int, int]:
    """Validate the sampling; return (window, shortest tone, longest tone) in samples."""
    nyquist_floor = 2 * COLUMN_HZ[-1] * (1 + _FREQ_JITTER)
    if sample_rate <= nyquist_floor:
        raise ValueError(
            f"sample_rate={sample_rate!r} is invalid: expected > {nyquist_floor:.0f} Hz "
            "(twice the highest jittered tone)"
        )
    num_samples = round(sample_rate * window_s)
    min_tone = round(sample_rate * _MIN_TONE_S)
    if num_samples < min_tone:
        raise ValueError(
            f"window_s={window_s!r} is invalid: expected >= {_MIN_TONE_S} s (the shortest tone)"
        )
    return num_samples, min_tone, min(round(sample_rate * _MAX_TONE_S), num_samples)


def dtmf_tones(
    digits: Sequence[int],
    rngs: Sequence[np.random.Generator | torch.Generator],
    sample_rate: int = SAMPLE_RATE,
    window_s: float = WINDOW_S,
) -> np.ndarray:
    """Randomised, noisy DTMF tones, one per digit, each drawn from its own generator.

    Row ``i`` depends only on ``digits[i]`` and the state of ``rngs[i]``, so it equals
    ``dtmf_tone(digits[i], rngs[i])``; the batch form only shares the sine evaluation.

    Args:
        digits: keypad digits in ``[0, 9]``.
        rngs: one generator per digit; each is advanced by the draws.
        sample_rate: samples per second; must keep the highest tone below Nyquist.
        window_s: window length in seconds; the tone lasts 60-120 ms (at most the window).

    Returns:
        Float64 ``[len(digits), round(sample_rate * window_s)]`` waveforms.

    Raises:
        ValueError: a bad digit, sample rate or window, or lengths that differ.
    """
    if len(digits) != len(rngs):
        raise ValueError(
            f"digits and rngs have lengths {len(digits)} and {len(rngs)}: expected equal"
        )
    num_samples, min_tone, max_tone = _check_rate(sample_rate, window_s)
    base_hz = np.array([dtmf_frequencies(d) for d in digits], dtype=np.float64).reshape(-1, 2)
    params = np.empty((len(digits), 8))
    noise = np.empty((len(digits), num_samples))
    for i, rng in enumerate(rngs):
        gen = _as_numpy_rng(rng)
        # One call draws every scalar parameter (fixed order), then the noise.
        params[i] = gen.random(8)
        noise[i] = gen.standard_normal(num_samples)
    num_tone = min_tone + np.floor(params[:, 0] * (max_tone - min_tone + 1)).astype(np.int64)
    offset = np.floor(params[:, 1] * (num_samples - num_tone + 1)).astype(np.int64)
    phases = params[:, 2:4]  # in cycles
    amplitude = _MIN_AMPLITUDE + (_MAX_AMPLITUDE - _MIN_AMPLITUDE) * params[:, 4]
    freqs = base_hz * (1 + _FREQ_JITTER * (2 * params[:, 5:7] - 1))
    noise_std = _MIN_NOISE_STD + (_MAX_NOISE_STD - _MIN_NOISE_STD) * params[:, 7]

    # Phase in cycles at each sample of the window, in float32 (halves the memory traffic
    # of these [B, 2, T] arrays, which dominates here): at <= 180 cycles its error is
    # ~1e-5 cycles, far below the ±1% jitter. Reduced to [0, 1) before the sine.
    cycles_per_sample = (freqs / sample_rate).astype(np.float32)
    start_phase = (phases - freqs * offset[:, None] / sample_rate).astype(np.float32)
    positions = np.arange(num_samples, dtype=np.float32)
    cycles = cycles_per_sample[:, :, None] * positions + start_phase[:, :, None]
    cycles -= np.floor(cycles)
    sines = np.sin(np.float32(2 * np.pi) * cycles).sum(axis=1)
    since_start = np.arange(num_samples)[None, :] - offset[:, None]
    envelope = (since_start >= 0) & (since_start < num_tone[:, None])
    tone = sines * (amplitude[:, None] * envelope)
    return tone + noise * noise_std[:, None]


def dtmf_tone(
    digit: int,
    rng: np.random.Generator | torch.Generator,
    sample_rate: int = SAMPLE_RATE,
    window_s: float = WINDOW_S,
) -> np.ndarray:
    """A randomised, noisy DTMF tone for one digit.

    Args:
        digit: keypad digit in ``[0, 9]``.
        rng: source of every random choice (the tone is a pure function of its state).
        sample_rate: samples per second; must keep 1.01 x 1477 Hz below Nyquist.
        window_s: window length in seconds; the tone lasts 60-120 ms (at most the window).

    Returns:
        Float64 waveform of ``round(sample_rate * window_s)`` samples.

    Raises:
        ValueError: bad digit, sample rate or window.
    """
    return dtmf_tones([digit], [rng], sample_rate, window_s)[0]


@functools.lru_cache(maxsize=4)
def _hann_window(n_fft: int) -> np.ndarray:
    """Periodic Hann window (as ``torch.hann_window``), built once per process."""
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)
    window.setflags(write=False)  # shared by every caller
    return window


def spectrogram(waveform: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Normalised log-magnitude spectrogram of one waveform or a batch of them.

    Equals ``torch.stft(n_fft=256, hop_length=64, window=hann, center=True)`` (reflect
    padding) followed by ``log1p(|.|)`` and the fixed normalisation, but is computed in
    float64 numpy: pocketfft is single-threaded, so building a batch never competes with
    torch's intra-op threads (which cost several times more than they save on arrays
    this small), and the result is rounded to float32 only at the end. Each row's
    result is therefore identical whatever batch it is computed in. Pass whole batches:
    one call for 64 tones is much cheaper than 64 calls.

    Args:
        waveform: ``[T]`` or ``[B, T]`` samples (numpy or torch, any float dtype),
            ``T > 128``.

    Returns:
        Float32 ``[129, F]`` or ``[B, 129, F]`` with ``F = 1 + T // 64`` frames (16 for the
        default 120 ms at 8 kHz), roughly zero mean and unit scale.

    Raises:
        ValueError: ``waveform`` is not 1-D or 2-D, or too short for reflect padding.
    """
    if isinstance(waveform, torch.Tensor):
        waveform = waveform.detach().cpu().numpy()
    wave = np.asarray(waveform, dtype=np.float64)
    if wave.ndim not in (1, 2) or wave.shape[-1] <= N_FFT // 2:
        raise ValueError(
            f"waveform has shape {wave.shape}: expected [T] or [B, T] samples with "
            f"T > {N_FFT // 2}"
        )
    pad = [(0, 0)] * (wave.ndim - 1) + [(N_FFT // 2, N_FFT // 2)]
    padded = np.pad(wave, pad, mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(padded, N_FFT, axis=-1)[..., ::HOP_LENGTH, :]
    z = np.fft.rfft(frames * _hann_window(N_FFT), axis=-1)  # [..., F, 129]
    magnitude = np.sqrt(z.real * z.real + z.imag * z.imag)
    features = (np.log1p(magnitude) - SPEC_MEAN) / SPEC_STD
    return torch.from_numpy(np.ascontiguousarray(np.swapaxes(features, -1, -2), np.float32))


def tone_spectrograms(
    digits: Sequence[int], rngs: Sequence[np.random.Generator | torch.Generator]
) -> torch.Tensor:
    """Spectrograms of one random tone per digit, with a single batched STFT.

    Args:
        digits: keypad digits.
        rngs: one generator per digit (same length as ``digits``).

    Returns:
        Float32 ``[len(digits), 129, 16]``.
    """
    if not digits:
        return torch.zeros(0, NUM_FREQ_BINS, NUM_FRAMES)
    waves = dtmf_tones(digits, rngs)
    return spectrogram(waves)


def peak_frequency_bins(spec: torch.Tensor, split_hz: float = 1075.0) -> tuple[int, int]:
    """Strongest frequency bin below and above ``split_hz`` (for checks and debugging).

    Args:
        spec: ``[129, F]`` spectrogram.
        split_hz: boundary between the row (low) and column (high) groups.

    Returns:
        ``(low_bin, high_bin)``; bin ``k`` is centred on ``k * 8000 / 256`` Hz.
    """
    profile = spec.mean(dim=-1)
    split_bin = round(split_hz * N_FFT / SAMPLE_RATE)
    low = int(profile[:split_bin].argmax())
    high = split_bin + int(profile[split_bin:].argmax())
    return low, high

import { ISlice } from './contracts';

const UNITS = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];

/**
 * Human size of a byte count in binary units: 3328599654 -> "3.1 GiB".
 *
 * One decimal from KiB up, none for bytes; null or non-finite input gives "—".
 */
export function formatBytes(bytes: number | null | undefined): string {
  if (bytes === null || bytes === undefined || !Number.isFinite(bytes)) {
    return '—';
  }
  let value = Math.abs(bytes);
  let unit = 0;
  while (value >= 1024 && unit < UNITS.length - 1) {
    value /= 1024;
    unit++;
  }
  const sign = bytes < 0 ? '-' : '';
  return unit === 0 ? `${sign}${value} B` : `${sign}${value.toFixed(1)} ${UNITS[unit]}`;
}

/**
 * "used / limit" sharing the unit of the limit: (3.1 GiB, 8 GiB) -> "3.1 / 8.0 GiB".
 */
export function formatPair(used: number, limit: number): string {
  const limitText = formatBytes(limit);
  const unit = limitText.split(' ')[1];
  const power = UNITS.indexOf(unit);
  if (power <= 0) {
    return `${formatBytes(used)} / ${limitText}`;
  }
  const scaled = used / Math.pow(1024, power);
  return `${scaled.toFixed(1)} / ${limitText}`;
}

/** A percentage with no decimals: 0.934 -> "93%"; null gives "—". */
export function formatPercent(fraction: number | null | undefined): string {
  if (fraction === null || fraction === undefined || !Number.isFinite(fraction)) {
    return '—';
  }
  return `${Math.round(fraction * 100)}%`;
}

/** A compression ratio: 1.456 -> "1.46×"; null or 0 gives "—". */
export function formatRatio(ratio: number | null | undefined): string {
  if (!ratio || !Number.isFinite(ratio)) {
    return '—';
  }
  return `${ratio.toFixed(2)}×`;
}

/** Seconds as "0.42 s" (two decimals below 10 s, one above); null gives "—". */
export function formatSeconds(seconds: number | null | undefined): string {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) {
    return '—';
  }
  return `${seconds < 10 ? seconds.toFixed(2) : seconds.toFixed(1)} s`;
}

/**
 * What a slice's compute share means under its isolation backend, worded as the Hub
 * words it (`jupyter_vgpu.slice.compute_share_text`): time-slicing enforces nothing, and
 * MPS's share comes from the server's environment, which the user's processes can change.
 */
export function computeShareText(slice: ISlice): string {
  switch (slice.isolation) {
    case 'time-slicing':
      return 'not enforced (time-sliced)';
    case 'mps':
      return `${slice.compute_share}% under MPS, not enforced (set in the server's environment)`;
    case 'mig': {
      const profile = slice.gpu_name.split(' MIG ')[1];
      return `MIG instance${profile ? ` ${profile.trim()}` : ''} (hardware partition)`;
    }
  }
}

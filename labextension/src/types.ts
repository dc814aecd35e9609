/** The slice of this server, as served by `/api/vgpu/usage` (sizes in bytes). */
export interface ISlice {
  gpu_uuid: string;
  gpu_index: number;
  gpu_name: string;
  gpu_memory: number;
  memory_limit: number;
  compute_share: number;
  placement: string;
  overcommit_ratio: number;
  simulated: boolean;
  idle_seconds: number;
  high_watermark: number;
  version: number;
}

/** The GPU the slice is on; `memory_used` and `sm_percent` are null when simulated. */
export interface IGPU {
  index: number;
  uuid: string;
  name: string;
  memory_total: number;
  memory_used: number | null;
  sm_percent: number | null;
}

/** Sums over the server's kernels, in bytes. */
export interface ITotals {
  used: number;
  reserved: number;
  offloaded: number;
  offloaded_compressed: number;
}

/** One kernel's usage, in bytes; `ratio` is raw / compressed bytes of what it offloaded. */
export interface IKernelUsage {
  id: string;
  name: string;
  pid: number | null;
  execution_state: string;
  used: number;
  torch_allocated: number;
  torch_reserved: number;
  nvml_memory: number | null;
  simulated_used: number;
  sm_percent: number | null;
  offloaded: number;
  offloaded_compressed: number;
  ratio: number | null;
  updated: number | null;
}

/** One usage document; `timestamp` in Unix seconds. */
export interface IUsage {
  slice: ISlice | null;
  simulated: boolean;
  pressure?: boolean;
  timestamp: number;
  gpu: IGPU | null;
  totals: ITotals;
  kernels: IKernelUsage[];
}

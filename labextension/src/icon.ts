import { LabIcon } from '@jupyterlab/ui-components';

const SVG = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">
  <g class="jp-icon3" fill="#616161">
    <path fill-rule="evenodd" d="M7.5 6h9A1.5 1.5 0 0 1 18 7.5v9a1.5 1.5 0 0 1-1.5 1.5h-9A1.5 1.5 0 0 1 6 16.5v-9A1.5 1.5 0 0 1 7.5 6zM8.5 8.5v7h7v-7z"/><rect x="10.5" y="10.5" width="3" height="3"/>
    <rect x="8" y="2.5" width="2" height="3.5"/><rect x="8" y="18" width="2" height="3.5"/><rect x="2.5" y="8" width="3.5" height="2"/><rect x="18" y="8" width="3.5" height="2"/><rect x="11" y="2.5" width="2" height="3.5"/><rect x="11" y="18" width="2" height="3.5"/><rect x="2.5" y="11" width="3.5" height="2"/><rect x="18" y="11" width="3.5" height="2"/><rect x="14" y="2.5" width="2" height="3.5"/><rect x="14" y="18" width="2" height="3.5"/><rect x="2.5" y="14" width="3.5" height="2"/><rect x="18" y="14" width="3.5" height="2"/>
  </g>
</svg>`;

/** The vGPU icon (a chip), themed through `jp-icon3`. */
export const vgpuIcon = new LabIcon({ name: 'jupyter-vgpu:chip', svgstr: SVG });

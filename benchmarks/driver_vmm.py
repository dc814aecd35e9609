"""What the driver's virtual-memory calls cost on a page of PyTorch's expandable segments.

A pause releases every unit of a kernel and a resume creates and maps each again
(``jupyter_vgpu/kernel/pause/native``); PyTorch's expandable segments are pages of
20 MiB, so 4.5 GiB is 231 units, against a few for its caching allocator. This measures,
in a plain process through cuda-bindings, for ``--pages`` pages of ``--page-mib`` MiB
side by side in one reserved range:

- ``release_s``: ``cuMemUnmap`` and ``cuMemRelease`` of every page, and ``create_map_s``:
  ``cuMemCreate`` and ``cuMemMap`` of every page, split across 1, 2, 4 and 8 threads of
  the process (each with the context current; cuda-bindings lets the GIL go), twice
  each, to see whether the driver runs them at once;
- ``access_s``: one ``cuMemSetAccess`` over all the pages;
- ``one_allocation``: one ``cuMemCreate`` of all the pages, then each page mapped at its
  offset into it (the way one physical allocation could stand behind many pages), and
  the driver's answer;
- ``whole_range``: one ``cuMemCreate`` of all the pages mapped once over the whole range
  (offset 0, its full size) and one ``cuMemSetAccess``, then released (``create_map_s``,
  ``access_s``, ``release_s``), beside the driver's answer to ``cuMemUnmap`` of one page
  inside that mapping (``unmap_one_page``): what a resume that backed a run of pages with
  one allocation would cost, and whether a caller could still give one page back.

Usage (GPU machine): ``python benchmarks/driver_vmm.py --out benchmarks/results/driver-vmm-h100.json``
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import provenance

try:
    from cuda.bindings import driver
except ImportError as e:  # --help still answers; a run says why it cannot start
    driver = None
    NO_DRIVER = f"cuda-bindings cannot be imported ({e}): pip install 'jupyter-vgpu[gpu]' on a GPU machine"

MiB = 1 << 20


def check(result, what: str):
    err = result[0]
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what}: {err.name}")
    return result[1] if len(result) > 1 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=231)
    parser.add_argument("--page-mib", type=int, default=20)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if driver is None:
        parser.error(NO_DRIVER)
    record = provenance.record()
    page, n = args.page_mib * MiB, args.pages

    check(driver.cuInit(0), "cuInit")
    device = check(driver.cuDeviceGet(0), "cuDeviceGet")
    ctx = check(driver.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
    check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    access = driver.CUmemAccessDesc()
    access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = 0
    access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    base = int(check(driver.cuMemAddressReserve(page * n, 0, 0, 0), "cuMemAddressReserve"))
    handles: list = [None] * n

    def create(i: int) -> None:
        handles[i] = check(driver.cuMemCreate(page, prop, 0), "cuMemCreate")
        check(driver.cuMemMap(base + i * page, page, 0, handles[i], 0), "cuMemMap")

    def release(i: int) -> None:
        check(driver.cuMemUnmap(base + i * page, page), "cuMemUnmap")
        check(driver.cuMemRelease(handles[i]), "cuMemRelease")

    def in_threads(step, k: int) -> float:
        errors: list[BaseException] = []

        def work(pages: range) -> None:
            try:
                check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
                for i in pages:
                    step(i)
            except BaseException as e:  # reported by the caller
                errors.append(e)

        shares = [range(j * n // k, (j + 1) * n // k) for j in range(k)]
        threads = [threading.Thread(target=work, args=(share,)) for share in shares]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return time.perf_counter() - start

    def set_access() -> float:
        start = time.perf_counter()
        check(driver.cuMemSetAccess(base, page * n, [access], 1), "cuMemSetAccess")
        return time.perf_counter() - start

    out = {**record, "pages": n, "page_bytes": page, "threads": {}}
    in_threads(create, 1)
    set_access()
    for k in (1, 2, 4, 8, 1, 2, 4, 8):
        released = in_threads(release, k)
        created = in_threads(create, k)
        row = {"release_s": released, "create_map_s": created, "access_s": set_access()}
        out["threads"].setdefault(str(k), []).append({key: round(v, 5) for key, v in row.items()})
    in_threads(release, 1)

    start = time.perf_counter()
    whole = check(driver.cuMemCreate(page * n, prop, 0), "cuMemCreate (all pages)")
    created = time.perf_counter() - start
    answer = "CUDA_SUCCESS"
    mapped = 0
    for i in range(n):
        err = driver.cuMemMap(base + i * page, page, i * page, whole, 0)[0]
        if err != driver.CUresult.CUDA_SUCCESS:
            answer = err.name
            break
        mapped += 1
    for i in range(mapped):
        check(driver.cuMemUnmap(base + i * page, page), "cuMemUnmap")
    check(driver.cuMemRelease(whole), "cuMemRelease")
    out["one_allocation"] = {
        "create_s": round(created, 5),
        "pages_mapped_at_offsets": mapped,
        "answer": answer,
    }
    whole_range = []
    for _ in range(3):
        start = time.perf_counter()
        whole = check(driver.cuMemCreate(page * n, prop, 0), "cuMemCreate (all pages)")
        check(driver.cuMemMap(base, page * n, 0, whole, 0), "cuMemMap (the whole range)")
        created = time.perf_counter() - start
        accessed = set_access()
        start = time.perf_counter()
        check(driver.cuMemUnmap(base, page * n), "cuMemUnmap (the whole range)")
        check(driver.cuMemRelease(whole), "cuMemRelease")
        released = time.perf_counter() - start
        whole_range.append({"create_map_s": created, "access_s": accessed, "release_s": released})
    whole_range = [{key: round(v, 5) for key, v in row.items()} for row in whole_range]
    whole = check(driver.cuMemCreate(page * n, prop, 0), "cuMemCreate (all pages)")
    check(driver.cuMemMap(base, page * n, 0, whole, 0), "cuMemMap (the whole range)")
    one_page = driver.cuMemUnmap(base + page, page)[0].name
    if driver.cuMemUnmap(base, page * n)[0] != driver.CUresult.CUDA_SUCCESS:  # one page went
        for i in range(n):
            driver.cuMemUnmap(base + i * page, page)
    check(driver.cuMemRelease(whole), "cuMemRelease")
    out["whole_range"] = {"runs": whole_range, "unmap_one_page": one_page}
    check(driver.cuMemAddressFree(base, page * n), "cuMemAddressFree")
    name = check(driver.cuDeviceGetName(64, device), "cuDeviceGetName")
    out["gpu"] = name.split(b"\0", 1)[0].decode()
    out["cuda_driver_api"] = check(driver.cuDriverGetVersion(), "cuDriverGetVersion")
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out))


if __name__ == "__main__":
    main()

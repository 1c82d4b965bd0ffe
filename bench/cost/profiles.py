"""Fitting measured points into the cost model's profiles: affine compute entries, alpha-beta links.

The points come from bench.runtime.probes (or from a stored profile, refitted without a device);
the fitted entries are what a device type's `profile:` file holds (bench.core.device_types.ComputeProfile).
"""

from __future__ import annotations

import time

import numpy as np

from bench.cost import link_bytes


def view_entry(points: list[tuple[int, float, float]]) -> dict:
    """The host's seconds per view call (forward and its backward node) from the two chains'
    (views, device seconds, host seconds); on a GPU the host's clock, on the CPU the wall."""
    (n1, _, h1), (n2, _, h2) = points
    return {"dispatch_s": max(h2 - h1, 0.0) / (n2 - n1), "points": points}


def _fit_affine(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept_s, units per second) of t = intercept + x / rate, least squares of the
    relative error (so the small points set the intercept and the large ones the rate, over
    sizes three orders apart); a non-positive intercept is 0 (the rate is then refitted
    through the origin)."""
    x, t = np.array([p[0] for p in points]), np.array([p[1] for p in points])
    slope, intercept = np.polyfit(x, t, 1, w=1.0 / t)
    if intercept <= 0 or slope <= 0:
        intercept, slope = 0.0, float((x @ t) / (x @ x))
    return float(intercept), float(1.0 / slope)


def fit_entry(points: list, units: str, per: int, host: bool) -> dict:
    """A profile entry from its points (size, device seconds, host seconds): the device's
    fixed seconds per kernel and rate (_fit_affine), and with `host` the host's seconds per
    kernel. Queueing a call costs the host the same at any size, but a large call can also
    make it wait for the device (a launch queue full behind the GPU sleep, or an allocation
    that synchronises: the host time can grow with the size, tracking the sleep;
    docs/cost-model.md, "Device types, host speed and profiles"), so the dispatch cost is the smallest of them."""
    intercept, rate = _fit_affine([(x, t) for x, t, _ in points])
    e = {"fixed_s": intercept / per, units: rate}
    if host:
        e["dispatch_s"] = min(h for _, _, h in points) / per
    return e


def refit(prof: dict) -> dict:
    """The profile with every entry fitted again from its stored points (today's fit_entry),
    for a profile measured before a change of the fit; no device needed."""
    gpu = prof.get("device", "cpu") != "cpu"  # "cpu", or the GPU's name
    out = {**prof, "compute": {}, "refit": f"fitted again from its points on {time.strftime('%Y-%m-%d')}"}
    for cls, e in prof["compute"].items():
        out["compute"][cls] = {**e, **fit_entry(e["points"], "flops_per_s", e["kernels_per_call"], gpu)}
    out["optimizer"] = {**prof["optimizer"], **fit_entry(prof["optimizer"]["points"], "bytes_per_s", 1, gpu)}
    if "views" in prof:  # older profiles did not measure view calls
        out["views"] = view_entry(prof["views"]["points"])
    return out


def fit_alpha_beta(rows: list[dict], n: int) -> dict[str, dict[str, float]]:
    """Least-squares t = alpha + link_bytes / bandwidth per (kind, impl), even shards only."""
    fits = {}
    for key in sorted({(r["kind"], r["impl"]) for r in rows}):
        pts = [r for r in rows if (r["kind"], r["impl"]) == key and r["first_share"] is None]
        # Grouped calls move each shard once over the root's link: bytes, not a ring's share.
        x = np.array([r["bytes"] if key[1] == "grouped" else link_bytes(key[0], r["bytes"], n) for r in pts])
        t = np.array([r["seconds"] for r in pts])
        slope, alpha = np.polyfit(x, t, 1)
        if slope > 0:
            fit = {"latency_s": max(float(alpha), 0.0), "bytes_per_s": float(1 / slope), "bandwidth_from": "fit"}
        else:  # sizes too small to see the bandwidth through the noise: a lower bound
            fit = {
                "latency_s": float(t.min()),
                "bytes_per_s": float(x.max() / t[x.argmax()]),
                "bandwidth_from": "largest size",
            }
        fits[f"{key[0]}/{key[1]}"] = fit
    return fits

"""One video, block by block: the flow schedule, noise, routers, the run types shared by both
schedulers (`types`), the per-video setup (`prepare`), the reference loop (`reference`, the oracle),
the native scheduler's driver (`native`), cross-device transfers and the stage backends."""

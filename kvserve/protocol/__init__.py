"""Contracts between the layers, imported by both sides of each boundary: the front-end <->
engine core messages (`engine_core`), the engine core <-> worker messages (`worker`) and the
stable block hash (`block_hash`) that engines and routers must compute alike. Nothing here
imports torch or the engine."""

"""Where a model runs: the engine options, GPU placement and the expert strategies (gpu,
offload, cpu, hybrid), the bandwidth figures that choose between them, and the expert audit."""

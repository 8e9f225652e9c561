"""What models run on: routing, KV caches, the CPU expert executor's binding, GPU ops, decode
steps as CUDA graphs, the expert slot tables and the expert-use profile format. Nothing here
imports the models, the engine that places them, or the front ends."""

"""Per-device memory of gpt_64k's train step, compiled from abstract shapes (nothing is
allocated), for its two launches: one GPU (context 1, 8 microbatches) and 8 GPUs
(context 4 x FSDP 2 with ring attention, 2 microbatches).

  python -m benchmarks.memory_gpt_64k      # writes results/memory_gpt_64k.json

The step is compiled for this machine's XLA:CPU over 8 simulated devices, so the
flash kernel is the Pallas interpreter's program and the buffer assignment is the CPU
compiler's: parameter, gradient and optimizer-state bytes are exact, activation (temp)
bytes are what XLA:CPU would need and only an estimate of a GPU's. Run it on a GPU
machine for the GPU compiler's figures (the JSON names the platform).
"""

import argparse
import json
import time

import jax

LAUNCHES = {
    'one_gpu_context1': dict(mesh=dict(fsdp=1, context=1), grad_accum=8),
    'eight_gpus_context4_fsdp2': dict(mesh=dict(fsdp=2, context=4), grad_accum=2),
}


def compile_launch(name: str, launch: dict) -> dict:
  # pylint: disable=import-outside-toplevel
  from sharding import planner
  from sharding.mesh import MESH_AXES
  from training import describe, plan
  from training.cli import load_config_file
  cfg = load_config_file('gpt_64k.py')
  layout = planner.Layout({a: launch['mesh'].get(a, 1) for a in MESH_AXES},
                          cfg.parallel.zero_stage, cfg.model.remat, launch['grad_accum'])
  devices = launch['mesh']['fsdp'] * launch['mesh']['context']
  size = describe.run_size(plan.configure(cfg, layout), devices)   # validates it too
  start = time.perf_counter()
  measured = plan.measure(cfg, layout)   # compiled from abstract shapes
  gib = lambda n: round(n / 2**30, 3)
  b, t = cfg.data.batch_size, cfg.data.seq_len
  return {
      'launch': name, 'mesh': size['mesh'], 'devices': devices,
      'grad_accum': layout.grad_accum,
      'microbatch_tokens_per_device': b // layout.grad_accum * t // devices,
      'attention': f'{cfg.model.attention_impl} ({cfg.parallel.context_strategy} when '
                   'context > 1)', 'remat': cfg.model.remat,
      'compiled_gib_per_device': {
          'arguments': gib(measured.argument_bytes), 'outputs': gib(measured.output_bytes),
          'aliased': gib(measured.alias_bytes), 'temps': gib(measured.temp_bytes),
          'peak_estimate': gib(measured.peak_bytes)},
      'state_gib_per_device': {'parameters': gib(size['param_bytes']),
                               'gradients': gib(size['grad_bytes']),
                               'optimizer_state': gib(size['opt_state_bytes'])},
      'compile_seconds': round(time.perf_counter() - start, 1),
      'collectives': {k: {'count': c, 'gib': gib(nbytes)}
                      for k, (c, nbytes) in measured.collectives.items()},
  }


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n', 1)[0])
  parser.add_argument('--output', metavar='PATH', help='also write the JSON here')
  args = parser.parse_args(argv)
  jax.config.update('jax_num_cpu_devices', 8)   # this entry point's own process only
  # pylint: disable=import-outside-toplevel
  from benchmarks.common import environment, write_result
  result = {'launches': [compile_launch(n, l) for n, l in LAUNCHES.items()],
            'note': 'compiled by this platform\'s XLA from abstract shapes; see the module '
                    'docstring for what the CPU figures mean'}
  if args.output:
    with open(args.output, 'w') as f:
      json.dump({'environment': environment(), **result}, f, indent=2)
  path = write_result('memory_gpt_64k', result)
  for launch in result['launches']:
    print(launch['launch'], launch['compiled_gib_per_device'], launch['compile_seconds'], 's')
  print(f'written to {path}')
  return result


if __name__ == '__main__':
  main()

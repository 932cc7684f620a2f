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
  from sharding import hlo
  from sharding.mesh import make_mesh
  from sharding.rules import make_plan
  from training import config as config_lib, describe, optimizer, state
  from training.cli import load_config_file
  cfg = load_config_file('gpt_64k.py')
  for axis, size in launch['mesh'].items():
    setattr(cfg.mesh, axis, size)
  cfg.optim.grad_accum = launch['grad_accum']
  devices = jax.devices()[:cfg.mesh.fsdp * cfg.mesh.context]
  config_lib.validate(cfg, len(devices))
  plan = make_plan(make_mesh(cfg.mesh, devices), cfg.parallel.zero_stage,
                   cfg.parallel.sequence_parallel, cfg.parallel.context_strategy,
                   cfg.parallel.context_load_balance)
  tx = optimizer.make_optimizer(cfg.optim, cfg.steps)
  step = state.make_train_step(cfg, plan, tx, optimizer.lr_schedule(cfg.optim, cfg.steps))
  b, t = cfg.data.batch_size, cfg.data.seq_len
  batch = {k: jax.ShapeDtypeStruct((b, t), dtype, sharding=plan.batch_sharding())
           for k, dtype in (('inputs', 'int32'), ('targets', 'int32'),
                            ('positions', 'int32'), ('weights', 'float32'))}
  start = time.perf_counter()
  report = hlo.inspect_compiled(step.lower(state.abstract_state(cfg, plan, tx), batch).compile())
  size = describe.run_size(cfg, len(devices))
  gib = lambda n: round(n / 2**30, 3)
  return {
      'launch': name, 'mesh': size['mesh'], 'devices': len(devices),
      'grad_accum': cfg.optim.grad_accum,
      'microbatch_tokens_per_device': b // cfg.optim.grad_accum * t // len(devices),
      'attention': f'{cfg.model.attention_impl} ({cfg.parallel.context_strategy} when '
                   'context > 1)', 'remat': cfg.model.remat,
      'compiled_gib_per_device': {
          'arguments': gib(report.argument_bytes), 'outputs': gib(report.output_bytes),
          'aliased': gib(report.alias_bytes), 'temps': gib(report.temp_bytes),
          'peak_estimate': gib(report.argument_bytes + report.output_bytes
                               - report.alias_bytes + report.temp_bytes)},
      'state_gib_per_device': {'parameters': gib(size['param_bytes']),
                               'gradients': gib(size['grad_bytes']),
                               'optimizer_state': gib(size['opt_state_bytes'])},
      'compile_seconds': round(time.perf_counter() - start, 1),
      'collectives': {k: {'count': v.count, 'gib': gib(v.bytes)}
                      for k, v in report.collectives.items()},
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

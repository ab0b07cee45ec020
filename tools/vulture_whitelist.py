"""Names vulture (``tests/test_dead_code.py``) reports as unused, each used
where vulture cannot see it. Not imported by the package."""

from smartvjp._api import smart_custom_vjp
from smartvjp._equinox import filter_custom_vjp

# Public methods: users call them (tests/test_api_parity.py, test_equinox.py).
smart_custom_vjp.defvjp_with_logs
smart_custom_vjp.defvjp_with_accums
smart_custom_vjp.defremat
smart_custom_vjp.defremat_with_logs
filter_custom_vjp.def_fwd
filter_custom_vjp.def_bwd

# Public: SwapReport.ok, what the docs' recipe checks (tests/test_swap.py).
from smartvjp._swap import SwapReport  # noqa: E402
SwapReport.ok

# _swap: a module's __builtins__ is what its code's builtins resolve to (the
# swapped copy of a module sees smart_custom_vjp through it).
__builtins__

# _versions.FLAGS: the list tests/test_versions.py checks against its table.
FLAGS

# _versions.SHIPS_TRITON_PALLAS_OPS: read by the tests and the migration
# recipe that swap JAX's Triton Pallas kernels, not by the package.
SHIPS_TRITON_PALLAS_OPS

# _api.smart_custom_vjp._remat: read back through self.__dict__ by defvjp
# (a defremat made first); the facade's old namespace _remat hid it.
_remat

# audit.Audit.apply: public, called by the user on their step.
apply

# audit.Capture.watch: public, called by the user's training loop.
watch

# audit/__init__.py: the module's class set to one that can be called
# (smartvjp.audit(fn, ...)).
__class__

# _schedule.ScheduledRule.equation: a public field of print_schedule's
# records (the JaxprEqn), read by their users, not by the package.
equation

# Primitive.multiple_results (smartvjp's primitives, RunCounter's step):
# read by JAX's bind and lowering, not by the package.
from smartvjp._primitive import _SmartPrimitive  # noqa: E402
_SmartPrimitive.multiple_results


# audit._calibrate.ADVICE: the advice's three words, which the tests and the
# docs' schema name (an Advice's kind is one of them).
from smartvjp.audit import _calibrate  # noqa: E402
_calibrate.ADVICE

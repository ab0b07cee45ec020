"""smartvjp: a drop-in ``jax.custom_vjp`` that never makes the remat mess.

Under ``jax.checkpoint``, ``jax.custom_vjp`` runs ``fwd`` in the forward pass,
drops its residuals and runs ``fwd`` again in the backward pass
(jax-ml/jax#21303). ``smart_custom_vjp`` runs ``f`` in the forward pass and
``fwd`` (or a fused ``fwd_bwd``) only in the rematerialized backward region.
"""

from smartvjp._api import smart_custom_vjp
from smartvjp._check import PrimalMismatchError, check_primals
from smartvjp._equinox import filter_custom_vjp

__version__ = "0.1.0"

__all__ = ["smart_custom_vjp", "filter_custom_vjp", "check_primals",
           "PrimalMismatchError", "__version__"]

"""Differential fuzzer: smartvjp.smart_custom_vjp against jax.custom_vjp.

Each program is generated as Python source that uses the names ``DEC`` (the
decorator) and ``DEFVJP`` (a helper that attaches the rules); it is executed
three times: with ``jax.custom_vjp``, with ``smartvjp.smart_custom_vjp`` and
with a "plain" decorator that ignores the rules (the un-customized function).

Results are compared leaf by leaf (tree structure, shapes, dtypes, values with
rtol 1e-5) and by exception type.  Where ``jax.custom_vjp`` raises, smartvjp's
result is compared with the plain function's; where the plain function raises
what ``jax.custom_vjp`` raises (JAX refuses the program itself), smartvjp
computing or refusing a rule with its own error is "smart better: ...", not
DIFF: a verdict starting with DIFF is always a difference to look at.

Usage (one worker process, results appended as JSON lines)::

  XLA_FLAGS=--xla_force_host_platform_device_count=4 PYTHONPATH=. \
    python tools/fuzz_dropin.py --seed 0 --count 200 --flags 0 --out out.jsonl
  python tools/fuzz_dropin.py --show SEED --flags 0   # print one program
"""

import argparse
import json
import os
import random
import sys
import time
import traceback

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

# --------------------------------------------------------------------------
# Rule sets.  Each defines F (with DEC), its rules, and apply(G, *xs) which
# returns one f32 array shaped like xs[0] (so layers can be chained/scanned).
# args: list of 'f' (f32 array of the program shape), 'w' (f32 (3,3)),
# 's' (f32 scalar), 'i' (int32 array of the program shape).
# exact: bwd is the derivative of f (forward mode can be checked against plain)
# --------------------------------------------------------------------------

RULES = {}

RULES["sincos"] = dict(args=["f"], exact=True, src='''
@DEC
def F(x):
    return jnp.sin(x)
def F_fwd(x):
    return jnp.sin(x), jnp.cos(x)
def F_bwd(c, g):
    return (g * c,)
DEFVJP(F, F_fwd, F_bwd)
def apply(G, x):
    return G(x)
''')

RULES["tanh_act"] = dict(args=["f"], exact=True, src='''
@DEC
def F(x):
    return jnp.tanh(x)
def F_fwd(x):
    y = jnp.tanh(x)
    return y, y
def F_bwd(y, g):
    return (g * (1.0 - y * y),)
DEFVJP(F, F_fwd, F_bwd)
def apply(G, x):
    return G(x)
''')

_GELU = '''
def _gelu_d(y):
    return jax.vmap(jax.vmap(jax.grad(jax.nn.gelu)))(y)
@DEC
def F(x, w):
    return jax.nn.gelu(x @ w)
'''

RULES["mm_gelu_xwy"] = dict(args=["m", "w"], exact=True, src=_GELU + '''
def F_fwd(x, w):
    y = x @ w
    return jax.nn.gelu(y), (x, w, y)
def F_bwd(res, g):
    x, w, y = res
    dy = g * _gelu_d(y)
    return dy @ w.T, x.T @ dy
DEFVJP(F, F_fwd, F_bwd)
def apply(G, x, w):
    return G(x, w)
''')

RULES["mm_gelu_mixed"] = dict(args=["m", "w"], exact=True, src=_GELU + '''
def F_fwd(x, w):
    y = x @ w
    return jax.nn.gelu(y), (x, w, y, _gelu_d(y))
def F_bwd(res, g):
    x, w, y, d = res
    dy = g * d
    return dy @ w.T, x.T @ dy
DEFVJP(F, F_fwd, F_bwd)
def apply(G, x, w):
    return G(x, w)
''')

RULES["floor_st"] = dict(args=["f"], exact=False, src='''
@DEC
def F(x):
    return jnp.floor(x)
def F_fwd(x):
    return jnp.floor(x), None
def F_bwd(_, g):
    return (g,)
DEFVJP(F, F_fwd, F_bwd)
def apply(G, x):
    return G(x) + 0.5 * x
''')

RULES["nondiff"] = dict(args=["f"], exact=True, src='''
def act(t):
    return jnp.tanh(t) * 1.5
@partial(DEC, nondiff_argnums=(0, 2))
def F(fn, x, k):
    return fn(x) * k
def F_fwd(fn, x, k):
    return fn(x) * k, x
def F_bwd(fn, k, x, g):
    return (jax.jvp(fn, (x,), (g,))[1] * k,)
DEFVJP(F, F_fwd, F_bwd)
def apply(G, x):
    return G(act, x, 2)
''')

RULES["pytree"] = dict(args=["f", "f", "s"], exact=True, src='''
@DEC
def F(d):
    a, (b, s) = d["a"], d["b"]
    return {"p": a * b, "q": (jnp.sin(s) * a,)}
def F_fwd(d):
    a, (b, s) = d["a"], d["b"]
    return F_impl(d), (a, b, s)
def F_impl(d):
    a, (b, s) = d["a"], d["b"]
    return {"p": a * b, "q": (jnp.sin(s) * a,)}
def F_bwd(res, g):
    a, b, s = res
    gp, (gq,) = g["p"], g["q"]
    da = gp * b + gq * jnp.sin(s)
    db = gp * a
    ds = jnp.sum(gq * a) * jnp.cos(s)
    return ({"a": da, "b": (db, ds)},)
DEFVJP(F, F_fwd, F_bwd)
def apply(G, x, y, s):
    o = G({"a": x, "b": (y, s)})
    return o["p"] + o["q"][0]
''')

RULES["resid_input"] = dict(args=["f"], exact=True, src='''
@DEC
def F(x):
    return x * jnp.sin(x)
def F_fwd(x):
    return x * jnp.sin(x), x
def F_bwd(x, g):
    return (g * (jnp.sin(x) + x * jnp.cos(x)),)
DEFVJP(F, F_fwd, F_bwd)
def apply(G, x):
    return G(x)
''')

RULES["int_input"] = dict(args=["f", "i"], exact=True, src='''
@DEC
def F(x, n):
    return x * n.astype(jnp.float32) + jnp.sin(x)
def F_fwd(x, n):
    return x * n.astype(jnp.float32) + jnp.sin(x), (jnp.cos(x), n)
def F_bwd(res, g):
    c, n = res
    return g * (n.astype(jnp.float32) + c), None
DEFVJP(F, F_fwd, F_bwd)
def apply(G, x, n):
    return G(x, n)
''')

_SYMZ = '''
@DEC
def F(x, y):
    return x * y, jnp.sin(x)
def F_fwd(x, y):
    xv, yv = x.value, y.value
    return (xv * yv, jnp.sin(xv)), (xv, yv)
def F_bwd(res, g):
    xv, yv = res
    g1, g2 = g
    dx = jnp.zeros_like(xv)
    dy = jnp.zeros_like(yv)
    if not isinstance(g1, SymbolicZero):
        dx = dx + g1 * yv
        dy = dy + g1 * xv
    if not isinstance(g2, SymbolicZero):
        dx = dx + g2 * jnp.cos(xv)
    return dx, dy
DEFVJP(F, F_fwd, F_bwd, symbolic_zeros=True)
'''
RULES["symzeros_both"] = dict(args=["f", "f"], exact=True, src=_SYMZ + '''
def apply(G, x, y):
    a, b = G(x, y)
    return a + b
''')
RULES["symzeros_first"] = dict(args=["f", "f"], exact=True, src=_SYMZ + '''
def apply(G, x, y):
    a, b = G(x, y)
    return a * 1.5
''')

RULES["ckpt_name"] = dict(args=["f"], exact=True, src='''
@DEC
def F(x):
    return jnp.exp(jnp.sin(x))
def F_fwd(x):
    s = checkpoint_name(jnp.sin(x), "r")
    c = checkpoint_name(jnp.cos(x), "c")
    y = jnp.exp(s)
    return y, (y, c)
def F_bwd(res, g):
    y, c = res
    return (g * y * c,)
DEFVJP(F, F_fwd, F_bwd)
def apply(G, x):
    return G(x)
''')

_FB = '''
@DEC
def F(x, w):
    return jnp.tanh(x * w)
def F_fwd(x, w):
    y = jnp.tanh(x * w)
    return y, (x, w, y)
def F_bwd(res, g):
    x, w, y = res
    d = g * (1.0 - y * y)
    return d * w, d * x
def F_fb(x, w, g):
    y = jnp.tanh(x * w)
    d = g * (1.0 - y * y)
    return d * w, d * x
'''
RULES["fwd_bwd"] = dict(args=["f", "f"], exact=True, src=_FB + '''
DEFVJP(F, F_fwd, F_bwd, fwd_bwd=F_fb)
def apply(G, x, w):
    return G(x, w)
''')
RULES["fwd_bwd_only"] = dict(args=["f", "f"], exact=True, src=_FB + '''
DEFVJP(F, F_fwd, F_bwd, fwd_bwd=F_fb, only_fb=True)
def apply(G, x, w):
    return G(x, w)
''')

RULES["pyfloat_arg"] = dict(args=["f", "p"], exact=True, src='''
@DEC
def F(x, a):
    return jnp.sin(x) * a
def F_fwd(x, a):
    return jnp.sin(x) * a, (jnp.cos(x), jnp.sin(x), a)
def F_bwd(res, g):
    c, s, a = res
    return g * c * a, jnp.sum(g * s)
DEFVJP(F, F_fwd, F_bwd)
def apply(G, x, a):
    return G(x, a)
''')

RULES["bf16_mixed"] = dict(args=["f", "b"], exact=True, src='''
@DEC
def F(x, y):
    return jnp.sin(x) * y.astype(jnp.float32)
def F_fwd(x, y):
    return jnp.sin(x) * y.astype(jnp.float32), (jnp.cos(x), jnp.sin(x), y)
def F_bwd(res, g):
    c, s, y = res
    return g * c * y.astype(jnp.float32), (g * s).astype(y.dtype)
DEFVJP(F, F_fwd, F_bwd)
def apply(G, x, y):
    return G(x, y)
''')

RULES["bwd_none"] = dict(args=["f", "f"], exact=False, src='''
@DEC
def F(x, y):
    return jnp.sin(x) * y
def F_fwd(x, y):
    return jnp.sin(x) * y, (jnp.cos(x), y)
def F_bwd(res, g):
    c, y = res
    return g * c * y, None
DEFVJP(F, F_fwd, F_bwd)
def apply(G, x, y):
    return G(x, y)
''')

RULES["bad_bwd_shape"] = dict(args=["f"], exact=True, src='''
@DEC
def F(x):
    return jnp.sin(x)
def F_fwd(x):
    return jnp.sin(x), jnp.cos(x)
def F_bwd(c, g):
    return (jnp.sum(g * c),)
DEFVJP(F, F_fwd, F_bwd)
def apply(G, x):
    return G(x)
''')

RULES["bad_bwd_notuple"] = dict(args=["f"], exact=True, src='''
@DEC
def F(x):
    return jnp.sin(x)
def F_fwd(x):
    return jnp.sin(x), jnp.cos(x)
def F_bwd(c, g):
    return g * c
DEFVJP(F, F_fwd, F_bwd)
def apply(G, x):
    return G(x)
''')

RULES["bad_bwd_arity"] = dict(args=["f", "f"], exact=True, src='''
@DEC
def F(x, y):
    return jnp.sin(x) * y
def F_fwd(x, y):
    return jnp.sin(x) * y, (jnp.cos(x), jnp.sin(x), y)
def F_bwd(res, g):
    c, s, y = res
    return (g * c * y,)
DEFVJP(F, F_fwd, F_bwd)
def apply(G, x, y):
    return G(x, y)
''')

RULES["bad_fwd_out"] = dict(args=["f"], exact=True, src='''
@DEC
def F(x):
    return jnp.sin(x)
def F_fwd(x):
    return (jnp.sin(x), jnp.sin(x)), jnp.cos(x)
def F_bwd(c, g):
    return (g * c,)
DEFVJP(F, F_fwd, F_bwd)
def apply(G, x):
    return G(x)
''')

RULES["bwd_dtype"] = dict(args=["f"], exact=True, src='''
@DEC
def F(x):
    return jnp.sin(x)
def F_fwd(x):
    return jnp.sin(x), jnp.cos(x)
def F_bwd(c, g):
    return ((g * c).astype(jnp.bfloat16),)
DEFVJP(F, F_fwd, F_bwd)
def apply(G, x):
    return G(x)
''')

RULES["int_bwd_zeros"] = dict(args=["f", "i"], exact=True, src='''
@DEC
def F(x, n):
    return x * n.astype(jnp.float32)
def F_fwd(x, n):
    return x * n.astype(jnp.float32), n
def F_bwd(n, g):
    return g * n.astype(jnp.float32), jnp.zeros_like(n)
DEFVJP(F, F_fwd, F_bwd)
def apply(G, x, n):
    return G(x, n)
''')

RULES["closure_sg"] = dict(args=["f", "f"], exact=True, src='''
def apply(G, x, s):
    c = lax.stop_gradient(jnp.cos(s))
    @DEC
    def F(x):
        return jnp.sin(x) * c
    def F_fwd(x):
        return jnp.sin(x) * c, jnp.cos(x) * c
    def F_bwd(r, g):
        return (g * r,)
    DEFVJP(F, F_fwd, F_bwd)
    return F(x)
F = None
''')

RULES["nested"] = dict(args=["f"], exact=True, src='''
@DEC
def F1(x):
    return jnp.sin(x)
def F1_fwd(x):
    return jnp.sin(x), jnp.cos(x)
def F1_bwd(c, g):
    return (g * c,)
DEFVJP(F1, F1_fwd, F1_bwd)
@DEC
def F(x):
    return F1(x) * x
def F_fwd(x):
    s = F1(x)
    return s * x, (x, s)
def F_bwd(res, g):
    x, s = res
    _, pb = jax.vjp(F1, x)
    (d,) = pb(g * x)
    return (d + g * s,)
DEFVJP(F, F_fwd, F_bwd)
def apply(G, x):
    return G(x)
''')

RULES["kwargs"] = dict(args=["f", "f"], exact=True, src='''
@DEC
def F(x, w, scale=1.0):
    return jnp.sin(x * w) * scale
def F_fwd(x, w, scale=1.0):
    return jnp.sin(x * w) * scale, (x, w, jnp.cos(x * w) * scale)
def F_bwd(res, g):
    x, w, c = res
    return g * c * w, g * c * x, jnp.sum(g * jnp.sin(x * w))
DEFVJP(F, F_fwd, F_bwd)
def apply(G, x, w):
    return G(x, w=w, scale=jnp.float32(0.5))
''')

RULES["multi_shape"] = dict(args=["f"], exact=True, src='''
@DEC
def F(x):
    return jnp.tanh(x)
def F_fwd(x):
    y = jnp.tanh(x)
    return y, y
def F_bwd(y, g):
    return (g * (1.0 - y * y),)
DEFVJP(F, F_fwd, F_bwd)
def apply(G, x):
    return G(x) + jnp.sum(G(x.reshape(-1)[:2])) + G(x[..., :1] * 2.0)
''')

_OPAQUE = {
    "f": ("K(lambda a, b: np.tanh(a * b), lambda a, b: jnp.tanh(a * b), x, w)",
          "jnp.tanh(x * w)", "d * w", "d * x"),
    "fwd": ("jnp.tanh(x * w)",
            "K(lambda a, b: np.tanh(a * b), lambda a, b: jnp.tanh(a * b), x, w)",
            "d * w", "d * x"),
    "bwd": ("jnp.tanh(x * w)", "jnp.tanh(x * w)",
            "K(lambda a, b: a * b, lambda a, b: a * b, d, w)",
            "K(lambda a, b: a * b, lambda a, b: a * b, d, x)"),
}
for _which, (_f, _fwd, _dx, _dw) in _OPAQUE.items():
    _src = '''
@DEC
def F(x, w):
    return %s
def F_fwd(x, w):
    y = %s
    return y, (x, w, y)
def F_bwd(res, g):
    x, w, y = res
    d = g * (1.0 - y * y)
    return %s, %s
def F_fb(x, w, g):
    y = jnp.tanh(x * w)
    d = g * (1.0 - y * y)
    return %s, %s
''' % (_f, _fwd, _dx, _dw, _dx, _dw)
    for _how, _defvjp_line in (("", "DEFVJP(F, F_fwd, F_bwd)"),
                               ("_with_fb", "DEFVJP(F, F_fwd, F_bwd, fwd_bwd=F_fb)"),
                               ("_fb_only", "DEFVJP(F, F_fwd, F_bwd, fwd_bwd=F_fb, only_fb=True)")):
        if _which == "fwd" and _how == "_fb_only":
            continue   # no fwd to make opaque there
        RULES["opaque_" + _which + _how] = dict(
            args=["f", "f"], exact=True,
            src=_src + _defvjp_line + "\ndef apply(G, x, w):\n    return G(x, w)\n")


def extras_rule(rng):
    """A rule set whose outputs hold constants, forwarded inputs and repeated
    values in random positions: primal outputs, residuals and cotangents.
    ``y = sin(x) * w`` (or ``sin(x) * 2`` when w only passes through) is the
    one computed output; bwd is the exact derivative."""
    w_in_y = rng.random() < 0.6
    extras = [rng.choice(["0.0", "jnp.float32(1.5)", "x", "w", "y",
                          "jnp.ones_like(x)"]) for _ in range(rng.randint(0, 3))]
    k = rng.randint(0, len(extras))
    outs = extras[:k] + ["y"] + extras[k:]
    res = ["c", "s", "w"] + [rng.choice(["0.0", "2", "jnp.float32(1.0)", "x",
                                         "w", "y", "c"])
                             for _ in range(rng.randint(0, 3))]
    rng.shuffle(res)
    ic, is_, iw = res.index("c"), res.index("s"), res.index("w")
    y_src = "jnp.sin(x) * w" if w_in_y else "jnp.sin(x) * 2.0"
    single = len(outs) == 1
    out_src = "y" if single else "(%s,)" % ", ".join(outs)

    def total(name):
        return " + ".join("g[%d]" % j for j, o in enumerate(outs) if o == name)
    gy = total("y")
    dx = "(%s) * c * %s" % (gy, "w_" if w_in_y else "2.0")
    if total("x"):
        dx += " + " + total("x")
    dw = "(%s) * s" % gy if w_in_y else ""
    if total("w"):
        dw = (dw + " + " if dw else "") + total("w")
    if not dw:
        dw = rng.choice(["None", "jnp.zeros_like(w_)"])
    only_fb = rng.random() < 0.25
    with_fb = only_fb or rng.random() < 0.4
    src = '''
@DEC
def F(x, w):
    y = %(y)s
    return %(out)s
def F_fwd(x, w):
    y = %(y)s
    c, s = jnp.cos(x), jnp.sin(x)
    return %(out)s, (%(res)s,)
def F_bwd(res, g):
    g = (g,) if %(single)s else g
    c, s, w_ = res[%(ic)d], res[%(is_)d], res[%(iw)d]
    return %(dx)s, %(dw)s
def F_fb(x, w, g):
    g = (g,) if %(single)s else g
    c, s, w_ = jnp.cos(x), jnp.sin(x), w
    return %(dx)s, %(dw)s
DEFVJP(F, F_fwd, F_bwd%(fb)s)
def apply(G, x, w):
    o = G(x, w)
    o = (o,) if %(single)s else o
    return sum(0.5 * jnp.broadcast_to(jnp.asarray(v, x.dtype), x.shape) for v in o)
''' % dict(y=y_src, out=out_src, res=", ".join(res), single=single, ic=ic,
           is_=is_, iw=iw, dx=dx, dw=dw,
           fb=(", fwd_bwd=F_fb, only_fb=True" if only_fb else
               ", fwd_bwd=F_fb" if with_fb else ""))
    return dict(args=["f", "f"], exact=True, src=src)


# --------------------------------------------------------------------------
# Issue 56's shapes (``--family residue56``; the classic family's seeds keep
# their programs): an effect with no outputs in f, fwd or bwd; a named
# residual computed inside a nested jit, named_call or custom_jvp (a helper,
# or the whole fwd); low-precision values saved under save-everything
# policies. Every program of this family is checkpointed once with a policy.
# --------------------------------------------------------------------------

RULES_56 = {}

_CB_MM = '''
@DEC
def F(x, w):
    %(f)s
    return jnp.tanh(x @ w)
def F_fwd(x, w):
    %(fwd)s
    y = checkpoint_name(x @ w, "r")
    return jnp.tanh(y), (x, w, y)
def F_bwd(res, g):
    x, w, y = res
    %(bwd)s
    d = g * (1.0 - jnp.tanh(y) ** 2)
    return d @ w.T, x.T @ d
DEFVJP(F, F_fwd, F_bwd)
def apply(G, x, w):
    return G(x, w)
'''
for _where in ("f", "fwd", "bwd"):
    _cb = {k: ("jax.debug.callback(lambda: None)" if k == _where else "pass")
           for k in ("f", "fwd", "bwd")}
    RULES_56["effect_no_outputs_in_" + _where] = dict(
        args=["m", "w"], exact=True, src=_CB_MM % _cb)

_NESTS = {
    "jit": "def NEST(fn):\n    return jax.jit(fn)\n",
    "named_call": "def NEST(fn):\n    return jax.named_call(fn, name='helper')\n",
    "custom_jvp": ("def NEST(fn):\n    g = jax.custom_jvp(fn)\n"
                   "    g.defjvp(lambda p, t: jax.jvp(fn, p, t))\n    return g\n"),
}
_NESTED_F = '''
@DEC
def F(x, w):
    return jnp.tanh(jnp.sin(x @ w) @ w)
'''
_NESTED_BWD = '''
def F_bwd(res, g):
    x, w, y, z = res
    gz = g * (1.0 - jnp.tanh(z) ** 2)
    gu = (gz @ w.T) * jnp.cos(x @ w)
    return gu @ w.T, y.T @ gz + x.T @ gu
DEFVJP(F, F_fwd, F_bwd)
def apply(G, x, w):
    return G(x, w)
'''
_NESTED_HELPER = '''
@NEST
def _named(x, w):
    return checkpoint_name(jnp.sin(x @ w), "r")
def F_fwd(x, w):
    y = _named(x, w)
    z = checkpoint_name(y @ w, "c")
    return jnp.tanh(z), (x, w, y, z)
'''
_NESTED_WHOLE = '''
@NEST
def F_fwd(x, w):
    y = checkpoint_name(jnp.sin(x @ w), "r")
    z = checkpoint_name(y @ w, "c")
    return jnp.tanh(z), (x, w, y, z)
'''
for _kind, _nest in _NESTS.items():
    RULES_56["nested_%s_helper" % _kind] = dict(
        args=["m", "w"], exact=True,
        src=_nest + _NESTED_F + _NESTED_HELPER + _NESTED_BWD)
    RULES_56["nested_%s_fwd" % _kind] = dict(
        args=["m", "w"], exact=True,
        src=_nest + _NESTED_F + _NESTED_WHOLE + _NESTED_BWD)

# a product whose fwd saves nothing, then a call whose fwd saves its input
# (the product): bwd reads the saved value, the forward output is the same
_LOW = '''
@DEC
def D(x):
    return x * x
DEFVJP(D, lambda x: (x * x, None), lambda _, g: (g,))
@DEC
def F(x):
    return x
def F_fwd(x):
    return x, x
def F_bwd(x, g):
    return (g * x,)
DEFVJP(F, F_fwd, F_bwd)
def apply(G, x):
    b = (1.0 + 0.01 * x).astype(jnp.%s)
    return G(D(b)).astype(jnp.float32) + x
'''
for _dt in ("bfloat16", "float16"):
    RULES_56["low_precision_" + _dt] = dict(args=["f"], exact=False,
                                            src=_LOW % _dt)

# --------------------------------------------------------------------------
# Issue 65's ring shape (``--family ring``): ring attention as ringattention
# 0.1.2 writes it (not its code): a custom_vjp run inside shard_map over 2
# devices whose fwd and bwd each scan the ring (psum of a constant for its
# size, axis_index, ppermute of the blocks, dot_generals) around an inner
# jax.checkpoint; checkpointed once with a policy, then wrapped as usual.
# --------------------------------------------------------------------------

RULES_RING = {}

_RING = '''
def _ring_perm(n):
    return [(j, (j + 1) %% n) for j in range(n)]
def _ring_block(q, k, v, carry):
    @partial(jax.checkpoint, prevent_cse=False%(policy)s)
    def block(carry, k, v):
        num, den, m = carry
        s = jnp.einsum("qd,kd->qk", q, k) / 2.0
        m_new = lax.stop_gradient(jnp.maximum(m, s.max(-1)))
        e = jnp.exp(s - m_new[:, None])
        corr = jnp.exp(m - m_new)
        return (num * corr[:, None] + jnp.einsum("qk,kd->qd", e, v),
                den * corr + e.sum(-1), m_new)
    return block(carry, k, v)
def F_fwd(q, k, v):
    n = lax.psum(1, "r")
    def body(c, idx):
        num, den, m, k, v = c
        del idx   # the block's source is (axis_index - idx) %% n
        num, den, m = _ring_block(q, k, v, (num, den, m))
        k, v = (lax.ppermute(x, "r", _ring_perm(n)) for x in (k, v))
        return (num, den, m, k, v), lax.axis_index("r")
    init = (jnp.zeros_like(q), jnp.zeros(q.shape[:1], q.dtype),
            jnp.full(q.shape[:1], -jnp.inf, q.dtype), k, v)
    (num, den, m, _, _), _ = lax.scan(body, init, jnp.arange(2))
    out = num / den[:, None]
    return out, (out, q, k, v, den, m)
@DEC
def F(q, k, v):
    return F_fwd(q, k, v)[0]
def F_bwd(res, g):
    out, q, k, v, den, m = res
    n = lax.psum(1, "r")
    dl_part = jnp.sum(g * out, -1)
    def body(c, idx):
        dq, dk, dv, k, v = c
        @partial(jax.checkpoint, prevent_cse=False%(policy)s)
        def block(dq, k, v):
            s = jnp.einsum("qd,kd->qk", q, k) / 2.0
            p = jnp.exp(s - m[:, None]) / den[:, None]
            dl = (jnp.einsum("qd,kd->qk", g, v) - dl_part[:, None]) * p
            return (dq + jnp.einsum("qk,kd->qd", dl, k) / 2.0,
                    jnp.einsum("qk,qd->kd", dl, q) / 2.0,
                    jnp.einsum("qk,qd->kd", p, g))
        dq, dk_part, dv_part = block(dq, k, v)
        dk, dv = dk + dk_part, dv + dv_part
        k, v, dk, dv = (lax.ppermute(x, "r", _ring_perm(n))
                        for x in (k, v, dk, dv))
        return (dq, dk, dv, k, v), None
    zeros = (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v))
    (dq, dk, dv, _, _), _ = lax.scan(body, (*zeros, k, v), jnp.arange(2))
    return dq, dk, dv
DEFVJP(F, F_fwd, F_bwd)
def apply(G, q, k, v):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("r",))
    return jax.shard_map(G, mesh=mesh, in_specs=(P("r"),) * 3,
                         out_specs=P("r"), check_vma=False)(q, k, v)
'''
for _name, _pol in (("", ""), ("_dots", ", policy=jax.checkpoint_policies."
                                        "dots_saveable")):
    RULES_RING["ring_attention" + _name] = dict(
        args=["m", "m", "m"], exact=True, src=_RING % dict(policy=_pol))

FAMILY = "classic"   # or "residue56", "ring" (--family)


POLICIES = [
    "None",
    "jax.checkpoint_policies.nothing_saveable",
    "jax.checkpoint_policies.everything_saveable",
    "jax.checkpoint_policies.dots_saveable",
    "jax.checkpoint_policies.save_only_these_names('r')",
    "jax.checkpoint_policies.save_only_these_names('c')",
    "jax.checkpoint_policies.save_only_these_names('r', 'c')",
    "jax.checkpoint_policies.save_and_offload_only_these_names("
    "names_which_can_be_saved=['r'], names_which_can_be_offloaded=['c'], "
    "offload_src='device', offload_dst='pinned_host')",
]

HEADER = '''import numpy as np
import jax, jax.numpy as jnp
from jax import lax
from functools import partial
from jax.custom_derivatives import SymbolicZero
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P
'''

PRELUDE_REPRO = '''import smartvjp
def _defvjp(kind):
    def DEFVJP(F, fwd, bwd, symbolic_zeros=False, fwd_bwd=None, only_fb=False):
        if kind == "smart" and only_fb:
            F.defvjp(fwd_bwd=fwd_bwd, symbolic_zeros=symbolic_zeros)
        elif kind == "smart" and fwd_bwd is not None:
            F.defvjp(fwd, bwd, symbolic_zeros=symbolic_zeros, fwd_bwd=fwd_bwd)
        elif kind == "jax" and only_fb:
            # the schedule smartvjp has with fwd_bwd alone, in jax.custom_vjp's
            # terms: f forward (the inputs are the residuals), fwd_bwd backward
            F.defvjp(lambda *a: (F.__wrapped__(*a), a),
                     lambda res, g: fwd_bwd(*res, g),
                     symbolic_zeros=symbolic_zeros)
        else:
            F.defvjp(fwd, bwd, symbolic_zeros=symbolic_zeros)
    return DEFVJP
class _Plain:
    def __init__(self, fun, nondiff_argnums=()):
        self.fun = fun
    def __call__(self, *a, **k):
        return self.fun(*a, **k)
    def defvjp(self, *a, **k):
        pass
def plain_dec(fun=None, nondiff_argnums=()):
    if fun is None:
        return lambda f: _Plain(f, nondiff_argnums)
    return _Plain(fun, nondiff_argnums)
KIND = "smart"   # "jax", "smart" or "plain"
DEC = {"jax": jax.custom_vjp, "smart": smartvjp.smart_custom_vjp, "plain": plain_dec}[KIND]
DEFVJP = _defvjp(KIND)
def K(np_fn, jnp_fn, *args):
    """An opaque kernel (a host callback, with no derivative and a result
    type without varying manual axes); the plain program computes jnp_fn."""
    if KIND == "plain":
        return jnp_fn(*args)
    like = jax.ShapeDtypeStruct(jnp.shape(args[0]), jnp.result_type(args[0]))
    return jax.pure_callback(
        lambda *a: np.asarray(np_fn(*a), like.dtype), like, *args,
        vmap_method="sequential")
'''


def _arr_src(a):
    if isinstance(a, float):
        return repr(a)
    return "np.array(%r, dtype=np.%s)" % (a.tolist(), a.dtype.name)


def gen_program(seed, flags, place="any"):
    """Return (meta, source).  The source defines ARGS and run().

    ``place="shard_map"`` puts every program inside ``jax.shard_map`` with
    ``check_vma=True`` (a batch of 4 over 4 devices, ``vmap`` per shard)."""
    import numpy as np
    rng = random.Random(seed)
    nrng = np.random.RandomState(seed)
    if FAMILY in ("residue56", "ring"):
        table = RULES_56 if FAMILY == "residue56" else RULES_RING
        rule = rng.choice(sorted(table))
        spec = table[rule]
    else:
        rule = rng.choice(sorted(RULES) + ["extras"] * 4)
        spec = RULES[rule] if rule != "extras" else extras_rule(rng)
    shape = rng.choice([(3,), (2, 3)])
    kinds = spec["args"]

    def mk(kind, batch=()):
        if kind == "f":
            return nrng.uniform(-1.5, 1.5, batch + shape).astype(np.float32)
        if kind == "m":
            return nrng.uniform(-1.5, 1.5, batch + (2, 3)).astype(np.float32)
        if kind == "w":
            return nrng.uniform(-1.0, 1.0, batch + (3, 3)).astype(np.float32)
        if kind == "s":
            return nrng.uniform(-1.5, 1.5, batch).astype(np.float32)
        if kind == "b":
            return nrng.uniform(-1.5, 1.5, batch + shape).astype(np.float32)
        if kind == "p":
            return float(np.float32(nrng.uniform(-1.5, 1.5)))
        if kind == "i":
            return nrng.randint(-2, 3, batch + shape).astype(np.int32)
        raise ValueError(kind)

    n = len(kinds)
    float_idx = [i for i, k in enumerate(kinds) if k != "i"]

    # ---- inner wrappers -------------------------------------------------
    lines = ["h = lambda *xs: apply(F, *xs)"]
    tags = []
    if FAMILY in ("residue56", "ring"):   # every policy, and JAX's save-all
        pol = rng.choice(POLICIES + ["lambda *_, **__: True"])
        tags.append("ckpt[%s]" % pol.split(".")[-1][:30])
        lines.append("h = jax.checkpoint(h, policy=%s)" % pol)
    for _ in range(rng.choice([0, 1, 1, 2, 2, 3])):
        w = rng.choice(["ckpt", "ckpt", "ckpt", "cond", "scan", "chain",
                        "sg", "jit", "vmap_in", "fori", "switch"])
        if w == "ckpt":
            pol = rng.choice(POLICIES)
            tags.append("ckpt[%s]" % pol.split(".")[-1][:30])
            lines.append("h = jax.checkpoint(h, policy=%s)" % pol)
        elif w == "cond":
            tags.append("cond")
            lines.append("h = (lambda h: lambda *xs: lax.cond(jnp.sum(xs[0]) > 0, h, "
                         "lambda *ys: 2.0 * h(*ys), *xs))(h)")
        elif w == "scan":
            tags.append("scan")
            if rng.random() < 0.6:
                pol = rng.choice(POLICIES[:4])
                lines.append("h = jax.checkpoint(h, policy=%s)" % pol)
                tags[-1] = "scan(ckpt[%s])" % pol.split(".")[-1]
            lines.append("h = (lambda h: lambda *xs: lax.scan(lambda c, _: "
                         "(h(c, *xs[1:]), None), xs[0], None, length=3)[0])(h)")
        elif w == "fori":
            tags.append("fori")
            lines.append("h = (lambda h: lambda *xs: lax.fori_loop(0, 2, lambda i, c: "
                         "h(c, *xs[1:]), xs[0]))(h)")
        elif w == "switch":
            tags.append("switch")
            lines.append("h = (lambda h: lambda *xs: lax.switch(jnp.int32(jnp.sum(xs[0]) > 0) + 1, "
                         "[lambda *ys: jnp.cos(ys[0]), h, lambda *ys: h(*ys) * 3.0], *xs))(h)")
        elif w == "chain":
            tags.append("chain")
            lines.append("h = (lambda h: lambda *xs: h(h(*xs), *xs[1:]))(h)")
        elif w == "sg":
            tags.append("stop_gradient")
            lines.append("h = (lambda h: lambda *xs: lax.stop_gradient(h(*xs)) "
                         "+ jnp.sin(xs[0]))(h)")
        elif w == "jit":
            tags.append("jit")
            lines.append("h = jax.jit(h)")
        elif w == "vmap_in":
            axes = tuple(0 if (i == 0 or rng.random() < 0.5) else None
                         for i in range(n))
            tags.append("vmap_in%s" % (axes,))
            stk = ", ".join(
                ("jnp.stack([xs[%d], xs[%d] + 1])" % (i, i)) if a == 0
                else "xs[%d]" % i for i, a in enumerate(axes))
            lines.append("h = (lambda h: lambda *xs: jax.vmap(h, in_axes=%r)(%s)"
                         "[0] * 0.5 + 0.0)(h)" % (axes, stk))
    # ---- outer ----------------------------------------------------------
    outers = ["value", "grad", "grad", "vag", "vjp", "vjp", "jvp",
              "linearize", "hessian", "gradgrad", "vmap_grad",
              "grad_vmap", "shard_map", "shard_map_in", "jacrev",
              "gradgrad_ckpt", "grad_aux", "hvp", "jacfwd_jacrev", "vmap_hvp"]
    if place == "shard_map" or FAMILY == "ring":
        # the program is inside one shard_map already (the ring's own, over
        # 2 devices: another over 4 would not nest)
        outers = [o for o in outers if o not in (
            "vmap_grad", "grad_vmap", "shard_map", "shard_map_in")]
    outer = rng.choice(outers)
    argnums = tuple(sorted(rng.sample(float_idx, rng.randint(1, len(float_idx)))))
    allow_int = ""
    if "i" in kinds and rng.random() < 0.2:
        argnums = tuple(sorted(argnums + (kinds.index("i"),)))
        allow_int = ", allow_int=True"
    lossf = rng.choice(["jnp.sum(h(*xs) ** 2)", "jnp.sum(jnp.sin(h(*xs)))"])
    lines.append("def loss(*xs):\n    return %s" % lossf)
    batch = ()
    axes = None
    if (outer in ("vmap_grad", "grad_vmap", "shard_map", "shard_map_in")
            or place == "shard_map"):
        bsz = 4 if (outer.startswith("shard_map") or place == "shard_map") else 2
        batch = (bsz,)
        axes = tuple(0 if (i == 0 or rng.random() < 0.6) else None for i in range(n))
    args = [mk(k, batch if (axes and axes[i] == 0) else ())
            for i, k in enumerate(kinds)]
    # a python float cannot be batched: keep it unmapped
    if axes is not None:
        axes = tuple(None if kinds[i] == "p" else ax for i, ax in enumerate(axes))
        args = [mk(k, batch if axes[i] == 0 else ()) if kinds[i] == "p" else a
                for i, (k, a) in enumerate(zip(kinds, args))]
    if place == "shard_map":
        ax = tuple(None if kinds[i] == "p" else a for i, a in enumerate(axes))
        specs = ", ".join("P('i')" if a == 0 else "P()" for a in ax)
        tags.append("in_shard_map%r" % (ax,))
        lines.append(
            "h = (lambda h: lambda *xs: jax.shard_map(lambda *ys: jax.vmap(h, "
            "in_axes=%r)(*ys), mesh=jax.sharding.Mesh(np.array(jax.devices()[:4]), "
            "('i',)), in_specs=(%s,), out_specs=P('i'), check_vma=True)(*xs))(h)"
            % (ax, specs))
    jit_outer = rng.random() < 0.4
    if outer == "value":
        body = "return h(*xs)"
    elif outer == "grad":
        body = "return jax.grad(loss, argnums=%r%s)(*xs)" % (argnums, allow_int)
    elif outer == "vag":
        body = "return jax.value_and_grad(loss, argnums=%r%s)(*xs)" % (argnums, allow_int)
    elif outer == "vjp":
        body = ("y, pb = jax.vjp(h, *xs)\n    "
                "ct = jnp.cos(jnp.arange(y.size, dtype=y.dtype).reshape(y.shape))\n    "
                "return y, pb(ct)")
    elif outer in ("jvp", "linearize"):
        tans = ", ".join(
            "np.zeros(np.shape(xs[%d]), jax.dtypes.float0)" % i if k == "i"
            else "jnp.cos(xs[%d] * 3.0)" % i for i, k in enumerate(kinds))
        if outer == "jvp":
            body = "return jax.jvp(h, tuple(xs), (%s,))" % tans
        else:
            body = "y, fj = jax.linearize(h, *xs)\n    return y, fj(%s)" % tans
    elif outer == "hessian":
        a = rng.choice(float_idx)
        body = "return jax.hessian(loss, argnums=%d)(*xs)" % a
    elif outer == "gradgrad":
        a = rng.choice(float_idx)
        b = rng.choice(float_idx)
        body = ("g = lambda *ys: jnp.sum(jnp.cos(jax.grad(loss, argnums=%d)(*ys)))\n    "
                "return jax.grad(g, argnums=%d)(*xs)" % (a, b))
    elif outer == "jacrev":
        body = "return jax.jacrev(h, argnums=%r%s)(*xs)" % (argnums, allow_int)
    elif outer in ("hvp", "vmap_hvp", "jacfwd_jacrev"):
        a = rng.choice(float_idx)
        grad_a = ("lambda y: jax.grad(loss, argnums=%d)(*xs[:%d], y, *xs[%d:])"
                  % (a, a, a + 1))
        if outer == "hvp":
            body = ("return jax.jvp(%s, (xs[%d],), (jnp.cos(3.0 * xs[%d]),))"
                    % (grad_a, a, a))
        elif outer == "vmap_hvp":
            body = ("v = jnp.stack([jnp.ones_like(xs[%d]), jnp.cos(xs[%d])])\n    "
                    "return jax.vmap(lambda t: jax.jvp(%s, (xs[%d],), (t,))[1])(v)"
                    % (a, a, grad_a, a))
        else:
            body = ("return jax.jacfwd(jax.jacrev(lambda y: loss(*xs[:%d], y, "
                    "*xs[%d:])))(xs[%d])" % (a, a + 1, a))
    elif outer == "gradgrad_ckpt":
        a = rng.choice(float_idx)
        b = rng.choice(float_idx)
        body = ("g = lambda *ys: jnp.sum(jnp.cos(jax.checkpoint(jax.grad(loss, argnums=%d))(*ys)))\n    "
                "return jax.grad(g, argnums=%d)(*xs)" % (a, b))
    elif outer == "grad_aux":
        body = ("return jax.grad(lambda *ys: (loss(*ys), h(*ys)), argnums=%r, has_aux=True%s)(*xs)"
                % (argnums, allow_int))
    elif outer == "vmap_grad":
        body = "return jax.vmap(jax.grad(loss, argnums=%r%s), in_axes=%r)(*xs)" % (
            argnums, allow_int, axes)
    elif outer == "grad_vmap":
        body = ("return jax.grad(lambda *ys: jnp.sum(jax.vmap(h, in_axes=%r)(*ys) ** 2), "
                "argnums=%r%s)(*xs)" % (axes, argnums, allow_int))
    elif outer == "shard_map":
        specs = ", ".join("P('i')" if a == 0 else "P()" for a in axes)
        body = ("mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ('i',))\n    "
                "sm = jax.shard_map(lambda *ys: jax.vmap(h, in_axes=%r)(*ys), mesh=mesh, "
                "in_specs=(%s,), out_specs=P('i'), check_vma=True)\n    "
                "return jax.grad(lambda *ys: jnp.sum(sm(*ys) ** 2), argnums=%r%s)(*xs)"
                % (axes, specs, argnums, allow_int))
    elif outer == "shard_map_in":
        specs = ", ".join("P('i')" if a == 0 else "P()" for a in axes)
        # grad inside the shard_map, of the per-shard loss; psum of the replicated grads
        body = ("mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ('i',))\n    "
                "def inner(*ys):\n        "
                "v, g = jax.value_and_grad(lambda *zs: jnp.sum(jax.vmap(h, in_axes=%r)(*zs) ** 2))(*ys)\n        "
                "return v[None], g\n    "
                "sm = jax.shard_map(inner, mesh=mesh, in_specs=(%s,), "
                "out_specs=(P('i'), P('i')), check_vma=True)\n    "
                "return sm(*xs)" % (axes, specs))
    tags.append(outer + ("%r" % (argnums,) if "grad" in outer or outer == "vag" else ""))
    if axes is not None:
        tags.append("axes%r" % (axes,))
    src = []
    src.append("ARGS = [%s]" % ", ".join(
        ("jnp.asarray(%s, jnp.bfloat16)" % _arr_src(a)) if k == "b" else _arr_src(a)
        for k, a in zip(kinds, args)))
    src.append(spec["src"].strip("\n"))
    src.extend(lines)
    src.append("def run(*xs):\n    %s" % body)
    if jit_outer:
        src.append("run = jax.jit(run)")
        tags.append("jit_outer")
    meta = dict(seed=seed, rule=rule, family=FAMILY, shape=list(shape), tags=tags, outer=outer,
                jit_outer=jit_outer, flags=flags, exact=spec["exact"], place=place)
    return meta, "\n".join(src) + "\n"


# --------------------------------------------------------------------------
def _execute(src, kind):
    import jax
    import numpy as np
    ns = {}
    pre = PRELUDE_REPRO.replace('KIND = "smart"', 'KIND = %r' % kind)
    exec(compile(HEADER + pre + src, "<program>", "exec"), ns)
    out = ns["run"](*[a if isinstance(a, float) else jax.numpy.asarray(a)
                      for a in ns["ARGS"]])
    leaves, tree = jax.tree_util.tree_flatten(out)
    weak = [bool(getattr(l, "weak_type", False)) for l in leaves]
    leaves = [np.asarray(l) for l in leaves]
    return str(tree) + " weak=%s" % weak, leaves


def _run_one(src, kind):
    try:
        return ("ok",) + _execute(src, kind)
    except Exception as e:  # noqa: BLE001 - we record every exception type
        msg = str(e).strip().splitlines()
        # the classes it is an instance of, so that an exception that is
        # both a TypeError and JAX's ValueError counts as either
        kinds = tuple(c.__name__ for c in type(e).__mro__
                      if issubclass(c, Exception) and c is not Exception)
        return ("err", type(e).__name__, msg[0][:300] if msg else "", kinds)


def _same_exc(ra, rb):
    """Both raise, and one's exception is an instance of the other's type."""
    return (ra[0] == rb[0] == "err"
            and (ra[1] == rb[1] or ra[1] in rb[3] or rb[1] in ra[3]))


def _close(a, b, rtol=1e-5):
    import numpy as np
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == np.dtype([("float0", "V")]) or str(a.dtype) == "[('float0', 'V')]":
        return True
    if a.dtype.kind in "V":
        return True
    scale = max(1.0, float(np.max(np.abs(b))) if b.size else 1.0)
    return bool(np.allclose(a, b, rtol=rtol, atol=1e-6 * scale, equal_nan=True))


def _cmp(ra, rb):
    """None if equal, else a short description."""
    if ra[0] == "err" or rb[0] == "err":
        if ra[0] == rb[0] == "err":
            return None if _same_exc(ra, rb) else "exc types %s vs %s" % (ra[1], rb[1])
        return "one raises: %s vs %s" % (ra[1] if ra[0] == "err" else "ok",
                                         rb[1] if rb[0] == "err" else "ok")
    if ra[1] != rb[1]:
        return "tree %s vs %s" % (ra[1], rb[1])
    for i, (a, b) in enumerate(zip(ra[2], rb[2])):
        if a.dtype != b.dtype:
            return "leaf %d dtype %s vs %s" % (i, a.dtype, b.dtype)
        if a.shape != b.shape:
            return "leaf %d shape %s vs %s" % (i, a.shape, b.shape)
        if not _close(a, b):
            return "leaf %d values differ (max abs diff %g)" % (
                i, float(abs(a.astype("f8") - b.astype("f8")).max()))
    return None


# smartvjp's refusal of a rule whose types cannot be made right (an opaque
# f's output type inside shard_map(check_vma=True): smartvjp/_spec.py)
REFUSALS = ("invariant along the manual mesh axes",)

# jax.custom_vjp's refusal of forward mode: there smartvjp goes beyond it
# (design/limitations.md), and the reference is the plain function. Under
# an outer jvp or linearize jax.custom_vjp never works (inside shard_map it
# may fail before it refuses: "unhashable type: 'list'" on jax 0.11/0.12)
FORWARD_MODE_REFUSAL = "can't apply forward-mode autodiff (jvp) to a custom_vjp"


def check(seed, flags, place="any"):
    meta, src = gen_program(seed, flags, place)
    rj = _run_one(src, "jax")
    rs = _run_one(src, "smart")
    res = dict(meta)
    res["jax"] = rj[0] if rj[0] == "ok" else "err:%s:%s" % (rj[1], rj[2])
    res["smart"] = rs[0] if rs[0] == "ok" else "err:%s:%s" % (rs[1], rs[2])
    if rs[0] == "err" and any(r in rs[2] for r in REFUSALS):
        # smartvjp refuses; that is right only where jax.custom_vjp raises too
        # or gives a value that differs from the plain function's
        rp = _run_one(src, "plain")
        res["plain"] = rp[0] if rp[0] == "ok" else "err:%s:%s" % (rp[1], rp[2])
        if rj[0] == "err":
            res["verdict"] = "refused (jax.custom_vjp raises %s)" % rj[1]
        elif rp[0] == "ok" and _cmp(rj, rp) is not None:
            res["verdict"] = "refused (jax.custom_vjp differs from plain)"
        else:
            res["verdict"] = "DIFF smart refuses, jax.custom_vjp is right"
    elif rj[0] == "ok":
        d = _cmp(rs, rj)
        res["verdict"] = "same" if d is None else "DIFF vs jax: " + d
        if d is None:   # within rtol 1e-5; also recorded: bit for bit?
            res["bitwise"] = all(a.tobytes() == b.tobytes()
                                 for a, b in zip(rs[2], rj[2]))
        if d is not None and rs[0] == "ok" and meta["exact"]:
            # is jax.custom_vjp the one that is wrong? (its rules are exact:
            # the plain function is the reference too)
            rp = _run_one(src, "plain")
            res["plain"] = rp[0] if rp[0] == "ok" else "err:%s:%s" % (rp[1], rp[2])
            if rp[0] == "ok" and _cmp(rs, rp) is None and _cmp(rj, rp) is not None:
                res["verdict"] = ("same-as-plain (jax.custom_vjp differs from "
                                  "plain: %s)" % _cmp(rj, rp))
    else:
        rp = _run_one(src, "plain")
        res["plain"] = rp[0] if rp[0] == "ok" else "err:%s:%s" % (rp[1], rp[2])
        res["verdict"] = verdict_where_jax_raises(meta, rj, rs, rp)
    return res


# Where JAX itself refuses the program (the plain function, without the
# rules, raises what jax.custom_vjp raises: JAX's pvary ValueError inside
# shard_map(check_vma=True) on jax 0.10.2), smartvjp computing, or refusing
# a rule that is wrong on purpose with its own error, is not a drop-in
# difference: labelled apart, so that DIFF always means one to look at.
SMART_COMPUTES = "smart better: computes where jax and plain raise"
SMART_REFUSES_RULE = "smart better: refuses the rule where jax and plain raise"


def verdict_where_jax_raises(meta, rj, rs, rp):
    """The verdict where jax.custom_vjp raises (``rj``): ``rs``, ``rp`` are
    smartvjp's and the plain function's results (``_run_one``'s tuples)."""
    if rs[0] == "err" and _same_exc(rs, rj):
        return "same"
    if rs[0] == "err" and (FORWARD_MODE_REFUSAL in rj[2]
                           or meta["outer"] in ("jvp", "linearize")):
        # forward mode, where smartvjp goes beyond jax.custom_vjp: it
        # reports what it finds wrong (a rule's output, an opaque rule);
        # listed for review, not a drop-in difference
        return "beyond (forward mode): smart raises %s" % rs[1]
    jax_refuses_program = rp[0] == "err" and _same_exc(rp, rj)
    if rs[0] == "err":
        if jax_refuses_program and "smart_custom_vjp" in rs[2]:
            return "%s %s" % (SMART_REFUSES_RULE, rj[1])
        return "DIFF exc types %s vs jax %s" % (rs[1], rj[1])
    if rp[0] == "err":
        if jax_refuses_program:
            return "%s %s" % (SMART_COMPUTES, rj[1])
        return "DIFF smart ok, jax raises %s, plain raises %s" % (rj[1], rp[1])
    if not meta["exact"]:
        return "unchecked (jax raises, rule not exact)"
    d = _cmp(rs, rp)
    return "same-as-plain" if d is None else "DIFF vs plain: " + d


def _differs(src):
    rj = _run_one(src, "jax")
    rs = _run_one(src, "smart")
    if rj[0] == "ok":
        return _cmp(rs, rj) is not None
    return not _same_exc(rs, rj)


def minimize(seed, flags, place="any"):
    """Greedily remove wrapper lines while smartvjp still differs from jax.custom_vjp."""
    _, src = gen_program(seed, flags, place)
    if not _differs(src):
        return "# seed %d: no discrepancy with jax.custom_vjp here" % seed
    lines = src.split("\n")
    i = 0
    while i < len(lines):
        if lines[i].startswith(("h = (", "h = jax.")) or lines[i] == "run = jax.jit(run)":
            trial = lines[:i] + lines[i + 1:]
            if _differs("\n".join(trial)):
                lines = trial
                continue
        i += 1
    return HEADER + PRELUDE_REPRO + "\n".join(lines) + "\nprint(run(*ARGS))\n"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--count", type=int, default=50)
    p.add_argument("--flags", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--show", type=int, default=None)
    p.add_argument("--minutes", type=float, default=1e9)
    p.add_argument("--minimize", type=int, default=None,
                   help="drop wrappers of this seed's program while the discrepancy stays")
    p.add_argument("--place", choices=("any", "shard_map"), default="any",
                   help="shard_map: every program inside shard_map(check_vma=True)")
    p.add_argument("--family", choices=("classic", "residue56", "ring"),
                   default="classic",
                   help="ring: issue 65's ring attention in shard_map over 2 "
                   "devices (--place any only); "
                   "residue56: issue 56's shapes (effects without outputs, "
                   "named residuals in nested calls, low precision), checkpointed")
    a = p.parse_args()
    global FAMILY
    FAMILY = a.family
    if FAMILY == "ring" and a.place != "any":
        p.error("--family ring runs its own shard_map: --place any only")
    if a.minimize is not None:
        import jax
        if a.flags:
            jax.config.update("jax_remat3", True)
            jax.config.update("jax_custom_vjp3", True)
        print(minimize(a.minimize, a.flags, a.place))
        return
    if a.show is not None:
        meta, src = gen_program(a.show, a.flags, a.place)
        print("# " + json.dumps(meta))
        if a.flags:
            print('import jax\njax.config.update("jax_remat3", True)\n'
                  'jax.config.update("jax_custom_vjp3", True)')
        print(HEADER + PRELUDE_REPRO + src)
        print("print(run(*ARGS))")
        return
    import jax
    if a.flags:
        jax.config.update("jax_remat3", True)
        jax.config.update("jax_custom_vjp3", True)
    out = open(a.out, "a") if a.out else sys.stdout
    t_end = time.time() + 60 * a.minutes
    for seed in range(a.seed, a.seed + a.count):
        if time.time() > t_end:
            break
        t0 = time.time()
        try:
            res = check(seed, a.flags, a.place)
        except Exception:  # harness bug
            res = dict(seed=seed, flags=a.flags, verdict="HARNESS " + traceback.format_exc()[-300:])
        res["secs"] = round(time.time() - t0, 2)
        res["jax_version"] = jax.__version__
        out.write(json.dumps(res) + "\n")
        out.flush()
        jax.clear_caches()


if __name__ == "__main__":
    main()

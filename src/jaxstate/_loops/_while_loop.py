from collections.abc import Callable
from typing import TypeVar

import jax.lax as lax


_T = TypeVar("_T")


def while_loop(
    cond_fun: Callable[[_T], object], body_fun: Callable[[_T], _T], init_val: _T
) -> _T:
    """`lax.while_loop` whose condition may read state that the body writes.

    JAX keeps a separate copy of any mutable state read in a loop condition, so with
    `lax.while_loop` the condition would never see the body's writes.
    This version evaluates `cond_fun` once before the loop and then at the end of
    each iteration, inside the body, carrying the predicate.

    **Arguments:** as `jax.lax.while_loop`.

    **Returns:** the final loop carry.

    !!! example

        ```python
        count = jaxstate.StateIndex(init=jnp.array(0))

        def body(i):
            jaxstate.set_state(count, jaxstate.get_state(count) + 1)
            return i + 1

        jaxstate.while_loop(lambda i: jaxstate.get_state(count) < 5, body, 0)
        ```
    """

    def body(carry):
        val, _ = carry
        val = body_fun(val)
        return val, cond_fun(val)

    val, _ = lax.while_loop(lambda c: c[1], body, (init_val, cond_fun(init_val)))
    return val

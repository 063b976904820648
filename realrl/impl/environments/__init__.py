"""Built-in environments; importing this package registers them (`"math"`)."""

from realrl.impl.environments import math_env  # noqa: F401

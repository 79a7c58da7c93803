"""cedar.frontend"""

from .executor_fix import install as _install_executor_fix

_install_executor_fix()

"""``python -m nbddp.agent <torchrun arguments>``: torchrun's process (``nbddp.agent.main``)."""

from . import exit_without_teardown, main

main()
exit_without_teardown(0)  # every rank ended well; a failure raised in main() and exits as torchrun does

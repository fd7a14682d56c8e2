from .cli import main
from .worker import exit_with

exit_with(main())  # a torchrun worker exits past torch's teardown

import sys

from gspmd.cli import main

sys.exit(main())

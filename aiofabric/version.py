"""The package's version, in one place: setuptools reads it, `aiofabric --version` prints it, and the driver
reports it to the firmware when it registers (HWRM func_drv_rgtr)."""
__version__ = "0.1.0"

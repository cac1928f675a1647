"""The conformance suite's parts, one theme per module, which
:class:`~asyncbus.testing.transport_suite.TransportSuite` puts together."""

"""Discovery sources: workers found by looking outside the gateway (DNS, ...), one module each."""

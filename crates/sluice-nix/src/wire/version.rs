//! Protocol versions: `major << 8 | minor` on the wire (`PROTOCOL_VERSION`,
//! `GET_PROTOCOL_MAJOR/MINOR` in `worker-protocol.hh`).

/// A worker-protocol version. Ordered by (major, minor).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ProtocolVersion {
    pub major: u8,
    pub minor: u8,
}

impl ProtocolVersion {
    /// The version `major.minor`.
    pub const fn new(major: u8, minor: u8) -> Self {
        ProtocolVersion { major, minor }
    }

    /// Decodes the wire form: bits 8–15 the major, bits 0–7 the minor; higher bits are
    /// ignored, as Nix ignores them.
    pub fn from_wire(n: u64) -> Self {
        ProtocolVersion { major: (n >> 8) as u8, minor: n as u8 }
    }

    /// The wire form `major << 8 | minor`.
    pub fn to_wire(self) -> u64 {
        (u64::from(self.major) << 8) | u64::from(self.minor)
    }

    /// Whether this (negotiated) version is at least `1.minor`.
    pub fn at_least(self, minor: u8) -> bool {
        self >= ProtocolVersion::new(1, minor)
    }
}

impl std::fmt::Display for ProtocolVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_and_order() {
        let v = ProtocolVersion::from_wire(0x122);
        assert_eq!(v, ProtocolVersion::new(1, 34));
        assert_eq!(v.to_wire(), 0x122);
        assert_eq!(v.min(ProtocolVersion::from_wire(0x1ff)), v);
        assert!(ProtocolVersion::new(2, 0) > ProtocolVersion::new(1, 255));
        assert!(v.at_least(34) && !v.at_least(35));
        assert_eq!(v.to_string(), "1.34");
    }
}

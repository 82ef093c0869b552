//! A certificate authority made by the test (rcgen), issuing server and
//! client certificates, for services the gateway reaches over TLS.

use rcgen::{BasicConstraints, Certificate, CertificateParams, DnType, IsCa, KeyPair};

pub struct TestCa {
    cert: Certificate,
    key: KeyPair,
}

/// A certificate the CA issued and its key, both PEM.
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
}

impl TestCa {
    /// A new CA named `name`.
    pub fn new(name: &str) -> TestCa {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        TestCa { cert, key }
    }

    pub fn pem(&self) -> String {
        self.cert.pem()
    }

    /// A certificate for `common_name` (a client's user name), valid for
    /// `names` (DNS names and IP addresses, for a server).
    pub fn issue(&self, common_name: &str, names: &[&str]) -> Issued {
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let mut params = CertificateParams::new(names).unwrap();
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.cert, &self.key).unwrap();
        Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }
}

//! Feeds arbitrary bytes to the gRPC request decoder: protobuf decoding, then validation of
//! inputs, raw contents and parameters. Any panic is a bug; every bad input must come back as
//! an error.

#![no_main]

use libfuzzer_sys::fuzz_target;
use npufleet_contract::proto::inference::ModelInferRequest;
use npufleet_worker::server::oip;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let Ok(request) = ModelInferRequest::decode(data) else {
        return;
    };
    if let Ok(decoded) = oip::decode_infer_request(&request) {
        let response = oip::build_response("m", &decoded, "text", &[1, 2, 3], Default::default());
        assert_eq!(
            response.outputs.len(),
            usize::from(decoded.outputs.text) + usize::from(decoded.outputs.ids)
        );
    }
    for raw in &request.raw_input_contents {
        let _ = oip::split_raw_bytes(raw);
    }
});

//! TEMPORARY stand-ins for the formats API (branch `formats`), removed once it is merged.
#![allow(dead_code)]

pub mod e2m1 {
    pub const VALUES: [f32; 16] =
        [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];
    pub fn decode(code: u8) -> f32 {
        VALUES[(code & 15) as usize]
    }
    pub fn encode_ties_even(x: f32) -> u8 {
        let a = x.abs();
        let i = match a {
            a if a <= 0.25 => 0,
            a if a < 0.75 => 1,
            a if a <= 1.25 => 2,
            a if a < 1.75 => 3,
            a if a <= 2.5 => 4,
            a if a < 3.5 => 5,
            a if a <= 5.0 => 6,
            _ => 7,
        };
        i | if x.is_sign_negative() && i != 0 { 8 } else { 0 }
    }
}

pub mod e4m3 {
    pub fn decode(b: u8) -> f32 {
        let s = if b & 0x80 != 0 { -1.0 } else { 1.0 };
        let e = ((b >> 3) & 15) as i32;
        let m = (b & 7) as f32;
        if e == 15 && b & 7 == 7 {
            return f32::NAN;
        }
        if e == 0 {
            s * m / 8.0 * 2f32.powi(-6)
        } else {
            s * (1.0 + m / 8.0) * 2f32.powi(e - 7)
        }
    }
    /// RNE, saturating to 448.
    pub fn round(x: f32) -> f32 {
        let a = x.abs();
        if a == 0.0 || a.is_nan() {
            return x;
        }
        let e = a.log2().floor().max(-6.0);
        let q = 2f32.powf(e - 3.0);
        ((a / q).round_ties_even() * q).min(448.0).copysign(x)
    }
}

pub mod e8m0 {
    pub fn decode(b: u8) -> f32 {
        if b == 255 {
            f32::NAN
        } else {
            2f32.powi(b as i32 - 127)
        }
    }
}

pub mod nvfp4 {
    pub fn dequantize_row(packed_row: &[u8], scales_row: &[u8], out: &mut [f32]) {
        for (j, o) in out.iter_mut().enumerate() {
            let b = packed_row[j / 2];
            let code = if j % 2 == 0 { b & 15 } else { b >> 4 };
            *o = super::e2m1::decode(code) * super::e4m3::decode(scales_row[j / 16]);
        }
    }
}

pub mod mxfp4 {
    pub fn dequantize_row(packed_row: &[u8], scales_row: &[u8], out: &mut [f32]) {
        for (j, o) in out.iter_mut().enumerate() {
            let b = packed_row[j / 2];
            let code = if j % 2 == 0 { b & 15 } else { b >> 4 };
            *o = super::e2m1::decode(code) * 2f32.powi(scales_row[j / 32] as i32 - 127);
        }
    }
}

pub mod act_quant {
    pub fn fp8_block128_ue8m0(x: &[f32], out: &mut [f32]) {
        for (xb, ob) in x.chunks(128).zip(out.chunks_mut(128)) {
            let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-4);
            let s = (amax * (1.0 / 448.0)).log2().ceil().exp2();
            for (o, v) in ob.iter_mut().zip(xb) {
                *o = super::e4m3::round((v / s).clamp(-448.0, 448.0)) * s;
            }
        }
    }
    pub fn nvfp4_block16(x: &[f32], global_scale: f32, out: &mut [f32]) {
        for (xb, ob) in x.chunks(16).zip(out.chunks_mut(16)) {
            let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let mut bs = amax / (6.0 * global_scale);
            if bs == 0.0 {
                bs = 1.0;
            }
            let bs = super::e4m3::round(bs);
            let denom = bs * global_scale;
            for (o, v) in ob.iter_mut().zip(xb) {
                *o = super::e2m1::decode(super::e2m1::encode_ties_even(v / denom)) * denom;
            }
        }
    }
}
